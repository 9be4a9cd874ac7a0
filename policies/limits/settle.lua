-- tokenway: apply one request's corrections (refund or extra charge), release its leases. Idempotent:
-- the first call removes the ticket (mode 'z') or sets a marker (mode 'm', for fail-open charges that
-- Redis never reserved); a retry finds it gone and changes nothing, so replaying after an outage
-- never counts twice.
--
-- KEYS: [1] tickets zset or marker key, then nb bucket hashes, nl lease zsets, nu budget hashes
-- ARGV: [1] now ('' = TIME) [2] ticket id [3] mode z|m [4] marker ttl s [5] budget delta usd
--       [6] the plan, space-separated: nb nl nu, per bucket rate/s, per budget period(day|month|run)
--       [7] bucket deltas, space-separated [8] budget period ids, space-separated
-- Returns 1 when applied, 0 when it had been applied already (or the ticket expired).
-- (fmt, num, fix, clock, words, numbers, drained, store_bucket, store_budget, period_id: policies/limits/preamble.lua)

local now = clock(ARGV[1])
local ticket, mode = ARGV[2], ARGV[3]
if mode == 'z' then
  if fix('ZREM', KEYS[1], ticket) == 0 then return 0 end
else
  if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[4])) then return 0 end
end
local delta_usd = tonumber(ARGV[5])
local plan = words(ARGV[6])
local deltas = numbers(ARGV[7])
local pids = numbers(ARGV[8])
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])

local stamp = nb > 0 and fmt(now) or ''
for i = 1, nb do
  local key = KEYS[1 + i]
  local rate, delta = tonumber(plan[3 + i]), deltas[i]
  if delta ~= 0 then
    local st = fix('HMGET', key, 'u', 't')
    local u = drained(num(st[1], 0), num(st[2], now), now, rate) + delta
    if u < 0 then u = 0 end
    store_bucket(key, u, stamp, rate, st[1] and delta < 0)
  end
end
for i = 1, nl do
  fix('ZREM', KEYS[1 + nb + i], ticket)
end
if delta_usd ~= 0 then
  for i = 1, nu do
    local key = KEYS[1 + nb + nl + i]
    local kind, pid = plan[3 + nb + i], pids[i]
    local st = fix('HMGET', key, 'p', 's')
    local p, s = num(st[1], nil), num(st[2], 0)
    local fresh = false
    if mode == 'm' and (p == nil or p < pid) then p, s, fresh = pid, 0, true end
    if p == pid then
      s = s + delta_usd
      if s < 0 then s = 0 end
      store_budget(key, fresh and tostring(pid), s, kind, fresh) -- (the id is written only when it changes)
    end
  end
end
return 1
