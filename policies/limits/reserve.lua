-- tokenway: reserve one request across every bucket, lease and budget that applies, all or nothing.
-- Same formulas as policies/limits/memory_store.py. Every key shares one hash tag ({prefix}), so the
-- script is one EVALSHA on one slot, also on Redis Cluster. Time is Redis's own (TIME) unless the
-- caller passes one (tests).
--
-- KEYS: [1] tickets zset [2] voided zset, then nb bucket hashes {u, t}, nl lease zsets, nu budget
--       hashes {p, s}
-- ARGV: [1] now ('' = TIME) [2] ticket id [3] lease ttl s [4] ticket ttl s [5] cost usd
--       [6] the plan, space-separated: nb nl nu, per bucket capacity rate/s shadow(0|1),
--           per lease capacity shadow, per budget limit-usd period(day|month|run) shadow
--       [7] the bucket costs, space-separated
--       A plan that counts an agent run has two more keys and three more arguments, the index of
--       live runs (policies/limits/standing.py): KEYS [n+1] zset run -> its last admitted call,
--       [n+2] hash run -> 'key model'; ARGV [8] the run ('tenant/program') [9] 'key model' [10] bound
-- (The plan string is built once per plan by the caller: fewer, cached arguments are cheaper to
-- send than one argument per number.)
-- Returns: {admitted 0|1|v, now, used x nb, active x nl, spent x nu, period x nu}, all as strings;
-- the state is the one decided on, before this request's charge.
--
-- Idempotent by ticket id: a ticket already reserved is not charged again (its state is reported as
-- it is, admitted 1), and a ticket voided before this script ran (void.lua, sent by a caller whose
-- reply timed out) is refused, admitted 'v': a reservation that runs late, after its caller gave up,
-- changes nothing.
-- (fmt, num, fix, clock, words, numbers, drained, store_bucket, store_budget, period_id: policies/limits/preamble.lua)

local now = clock(ARGV[1])
local stamp = fmt(now)
local ticket = ARGV[2]
local lease_ttl, ticket_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost_usd = tonumber(ARGV[5])
local plan = words(ARGV[6])
local costs = numbers(ARGV[7])
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])
local base = 2 -- keys before the first bucket

local ok = 1
if fix('ZSCORE', KEYS[2], ticket) then
  ok = 'v'
elseif fix('ZSCORE', KEYS[1], ticket) then
  ok = 'again'
end
local out = {}
local used, rates = {}, {}
local a = 4
for i = 1, nb do
  local cap, rate, shadow = tonumber(plan[a]), tonumber(plan[a + 1]), plan[a + 2]
  a = a + 3
  local st = fix('HMGET', KEYS[base + i], 'u', 't')
  local u = drained(num(st[1], 0), num(st[2], now), now, rate)
  used[i], rates[i] = u, rate
  if ok == 1 and shadow == '0' and u + costs[i] > cap then ok = 0 end
end
local active = {}
for i = 1, nl do
  local key = KEYS[base + nb + i]
  local cap, shadow = tonumber(plan[a]), plan[a + 1]
  a = a + 2
  fix('ZREMRANGEBYSCORE', key, '-inf', now)
  -- a lease's score is a time (its expiry): one past any time (an infinite score, which no script
  -- writes) would hold a slot for as long as the key lives, and is not counted
  local n = redis.call('ZCOUNT', key, '-inf', '1e15')
  active[i] = n
  if ok == 1 and shadow == '0' and n + 1 > cap then ok = 0 end
end
-- per budget: spend (number, and as stored: reported as read, not formatted again), period id
-- (string), kind, whether this write starts its period
local spent, spent_s, periods, kinds, fresh = {}, {}, {}, {}, {}
local pid_of, pid_s_of = {}, {} -- the hierarchy's budgets mostly share a period: its calendar runs once
for i = 1, nu do
  local limit, kind, shadow = tonumber(plan[a]), plan[a + 1], plan[a + 2]
  a = a + 3
  local pid = pid_of[kind]
  if pid == nil then
    pid = period_id(kind, now)
    pid_of[kind], pid_s_of[kind] = pid, tostring(pid)
  end
  local st = fix('HMGET', KEYS[base + nb + nl + i], 'p', 's')
  local s, s_text = 0, '0'
  local same = num(st[1], nil) == pid
  local v = same and num(st[2], nil)
  if v then s, s_text = v, st[2] end
  if string.find(s_text, '[xX]') then s_text = fmt(s) end -- a hex number: Lua reads it, the caller would not
  spent[i], spent_s[i], periods[i], kinds[i], fresh[i] = s, s_text, pid_s_of[kind], kind, not same
  if ok == 1 and shadow == '0' and s + cost_usd > limit then ok = 0 end
end

if ok == 1 then
  for i = 1, nb do
    store_bucket(KEYS[base + i], used[i] + costs[i], stamp, rates[i])
  end
  for i = 1, nl do
    local key = KEYS[base + nb + i]
    redis.call('ZADD', key, now + lease_ttl, ticket)
    redis.call('PEXPIRE', key, math.ceil(lease_ttl * 1000) + 1000)
  end
  for i = 1, nu do
    store_budget(KEYS[base + nb + nl + i], periods[i], spent[i] + cost_usd, kinds[i], fresh[i])
  end
  -- the ticket makes settle idempotent: it applies only while the ticket is still there to remove
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('ZADD', KEYS[1], now + ticket_ttl, ticket)
  local n = base + nb + nl + nu
  if #KEYS > n then -- an agent run: note it in the index of live runs, bounded (oldest leave in a batch)
    local runs, meta, run = KEYS[n + 1], KEYS[n + 2], ARGV[8]
    fix('ZADD', runs, now, run)
    fix('HSET', meta, run, ARGV[9])
    local bound = tonumber(ARGV[10])
    local count = redis.call('ZCARD', runs)
    if count > bound + 64 then
      local old = redis.call('ZRANGE', runs, 0, count - bound - 1)
      redis.call('ZREMRANGEBYRANK', runs, 0, count - bound - 1)
      redis.call('HDEL', meta, unpack(old))
    end
    redis.call('PEXPIRE', runs, 2764800000)
    redis.call('PEXPIRE', meta, 2764800000)
  end
end

if ok == 'again' then ok = 1 end
out[1] = tostring(ok)
out[2] = stamp
for i = 1, nb do out[#out + 1] = fmt(used[i]) end
for i = 1, nl do out[#out + 1] = tostring(active[i]) end
for i = 1, nu do out[#out + 1] = spent_s[i] end
for i = 1, nu do out[#out + 1] = periods[i] end
return out
