-- tokenway: reserve one request across every bucket, lease and budget that applies, all or nothing.
-- Same formulas as policies/limits/buckets.py. Every key shares one hash tag ({prefix}), so the
-- script is one EVALSHA on one slot, also on Redis Cluster. Time is Redis's own (TIME) unless the
-- caller passes one (tests).
--
-- KEYS: [1] tickets zset [2] voided zset, then nb bucket hashes {u, t}, nl lease zsets, nu budget
--       hashes {p, s}
-- ARGV: [1] now ('' = TIME) [2] ticket id [3] lease ttl s [4] ticket ttl s [5] cost usd
--       [6] the plan, space-separated: nb nl nu, per bucket capacity rate/s shadow(0|1),
--           per lease capacity shadow, per budget limit-usd period(day|month|run) shadow
--       [7] the bucket costs, space-separated
-- (The plan string is built once per plan by the caller: fewer, cached arguments are cheaper to
-- send than one argument per number.)
-- Returns: {admitted 0|1|v, now, used x nb, active x nl, spent x nu, period x nu}, all as strings;
-- the state is the one decided on, before this request's charge.
--
-- Idempotent by ticket id: a ticket already reserved is not charged again (its state is reported as
-- it is, admitted 1), and a ticket voided before this script ran (void.lua, sent by a caller whose
-- reply timed out) is refused, admitted 'v': a reservation that runs late, after its caller gave up,
-- changes nothing.
-- (fmt, clock, words, numbers, drained, store_bucket, period_id: policies/limits/preamble.lua)

local now = clock(ARGV[1])
local ticket = ARGV[2]
local lease_ttl, ticket_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost_usd = tonumber(ARGV[5])
local plan = words(ARGV[6])
local costs = numbers(ARGV[7])
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])
local base = 2 -- keys before the first bucket

local ok = 1
if redis.call('ZSCORE', KEYS[2], ticket) then
  ok = 'v'
elseif redis.call('ZSCORE', KEYS[1], ticket) then
  ok = 'again'
end
local out = {}
local used, rates = {}, {}
local a = 4
for i = 1, nb do
  local cap, rate, shadow = tonumber(plan[a]), tonumber(plan[a + 1]), plan[a + 2]
  a = a + 3
  local st = redis.call('HMGET', KEYS[base + i], 'u', 't')
  local u = drained(tonumber(st[1]) or 0, tonumber(st[2]) or now, now, rate)
  used[i], rates[i] = u, rate
  if ok == 1 and shadow == '0' and u + costs[i] > cap then ok = 0 end
end
local active = {}
for i = 1, nl do
  local key = KEYS[base + nb + i]
  local cap, shadow = tonumber(plan[a]), plan[a + 1]
  a = a + 2
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local n = redis.call('ZCARD', key)
  active[i] = n
  if ok == 1 and shadow == '0' and n + 1 > cap then ok = 0 end
end
local spent, periods, kinds = {}, {}, {}
for i = 1, nu do
  local limit, kind, shadow = tonumber(plan[a]), plan[a + 1], plan[a + 2]
  a = a + 3
  local pid = period_id(kind, now)
  local st = redis.call('HMGET', KEYS[base + nb + nl + i], 'p', 's')
  local s = 0
  if tonumber(st[1]) == pid then s = tonumber(st[2]) or 0 end
  spent[i], periods[i], kinds[i] = s, pid, kind
  if ok == 1 and shadow == '0' and s + cost_usd > limit then ok = 0 end
end

if ok == 1 then
  for i = 1, nb do
    store_bucket(KEYS[base + i], used[i] + costs[i], now, rates[i])
  end
  for i = 1, nl do
    local key = KEYS[base + nb + i]
    redis.call('ZADD', key, now + lease_ttl, ticket)
    redis.call('PEXPIRE', key, math.ceil(lease_ttl * 1000) + 1000)
  end
  for i = 1, nu do
    local key = KEYS[base + nb + nl + i]
    redis.call('HSET', key, 'p', periods[i], 's', fmt(spent[i] + cost_usd))
    redis.call('EXPIRE', key, kinds[i] == 'day' and 172800 or 2764800)
  end
  -- the ticket makes settle idempotent: it applies only while the ticket is still there to remove
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('ZADD', KEYS[1], now + ticket_ttl, ticket)
end

if ok == 'again' then ok = 1 end
out[1] = tostring(ok)
out[2] = fmt(now)
for i = 1, nb do out[#out + 1] = fmt(used[i]) end
for i = 1, nl do out[#out + 1] = tostring(active[i]) end
for i = 1, nu do out[#out + 1] = fmt(spent[i]) end
for i = 1, nu do out[#out + 1] = tostring(periods[i]) end
return out
