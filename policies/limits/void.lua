-- tokenway: void a reservation whose outcome the caller does not know (its reply timed out or the
-- connection broke after the command was sent). Order-independent: the ticket is recorded as voided
-- first, so a reservation that runs after this script is refused by reserve.lua; a reservation that
-- ran before is undone here (every bucket and budget refunded, every lease released). Idempotent: a
-- second void finds the ticket gone and changes nothing; a settled ticket is gone too, so voiding it
-- is harmless.
--
-- KEYS: [1] tickets zset [2] voided zset, then nb bucket hashes, nl lease zsets, nu budget hashes
-- ARGV: [1] now ('' = TIME) [2] ticket id [3] voided ttl s [4] ticket ttl s (as reserve.lua got it)
--       [5] cost usd reserved [6] the plan, space-separated: nb nl nu, per bucket rate/s, per budget
--       period(day|month|run) [7] bucket costs reserved, space-separated
-- Returns 1 when a reservation was undone, 0 when there was none (not run yet, settled, or voided).
-- (fmt, num, fix, clock, words, numbers, drained, store_bucket, period_id: policies/limits/preamble.lua)

local now = clock(ARGV[1])
local ticket = ARGV[2]
local voided_ttl, ticket_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost_usd = tonumber(ARGV[5])
fix('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + voided_ttl, ticket)
redis.call('PEXPIRE', KEYS[2], math.ceil(voided_ttl * 1000) + 1000)
local expires = fix('ZSCORE', KEYS[1], ticket)
if not expires then return 0 end
redis.call('ZREM', KEYS[1], ticket)
local reserved_at = tonumber(expires) - ticket_ttl

local plan = words(ARGV[6])
local costs = numbers(ARGV[7])
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])
local base = 2
local stamp = fmt(now)

for i = 1, nb do
  local key = KEYS[base + i]
  local rate = tonumber(plan[3 + i])
  local st = fix('HMGET', key, 'u', 't')
  if st[1] then
    local u = drained(num(st[1], 0), num(st[2], now), now, rate) - costs[i]
    if u < 0 then u = 0 end
    store_bucket(key, u, stamp, rate, costs[i] >= 0)
  end
end
for i = 1, nl do
  fix('ZREM', KEYS[base + nb + i], ticket)
end
if cost_usd ~= 0 then
  for i = 1, nu do
    local key = KEYS[base + nb + nl + i]
    local kind = plan[3 + nb + i]
    local st = fix('HMGET', key, 'p', 's')
    -- the budget period the reservation charged: the one current when it ran
    if num(st[1], nil) == period_id(kind, reserved_at) then
      local s = num(st[2], 0) - cost_usd
      if s < 0 then s = 0 end
      redis.call('HSET', key, 's', fmt(s))
    end
  end
end
return 1
