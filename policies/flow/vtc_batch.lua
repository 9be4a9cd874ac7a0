-- The changes one replica made to one (pool, band) since its last call, applied atomically
-- (policies/flow/redis_counters.py). Each tenant's changes are folded into one map
-- v -> max(v + add, floor): a lift is a floor, a charge an add, and any sequence of them composes.
-- KEYS[1]: hash tenant -> counter; KEYS[2]: the counter of the tenant dispatched last
-- ARGV[1]: TTL in ms; ARGV[2..4]: the batch's last dispatch: tenant ('' = none), and the map of its
--   changes up to just before its charge (add, floor; '' = no floor): its counter then is the band's
--   last served; ARGV[5..]: tenant, add, floor ('' = no floor), one triple per changed tenant
-- Returns {last served, counters as a flat field/value list}: the caller's view of the whole band.
-- (fmt, num, fix: policies/limits/preamble.lua: a counter no script wrote reads as 0)
local counters, last = KEYS[1], KEYS[2]
local function mapped(value, add, floor)
  value = value + tonumber(add)
  if floor ~= '' then
    local f = tonumber(floor)
    if f > value then value = f end
  end
  return value
end
local served
if ARGV[2] ~= '' then
  served = mapped(num(fix('HGET', counters, ARGV[2]), 0), ARGV[3], ARGV[4])
end
for i = 5, #ARGV, 3 do
  local before = num(fix('HGET', counters, ARGV[i]), 0)
  local after = mapped(before, ARGV[i + 1], ARGV[i + 2])
  if after ~= before then
    redis.call('HSET', counters, ARGV[i], fmt(after))
  end
end
if served then
  redis.call('SET', last, fmt(served), 'PX', ARGV[1])
end
redis.call('PEXPIRE', counters, ARGV[1])
local served_last = redis.pcall('GET', last)
if type(served_last) ~= 'string' then served_last = '0' end -- none, or a key of another type
return {served_last, fix('HGETALL', counters)}
