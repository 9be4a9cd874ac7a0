-- The changes one replica made to one tenant's programs since its last call, and a read of the
-- programs waiting there (policies/flow/redis_counters.py). A program's attained service is stored as
-- its value at its last change and when that was (Redis's clock); it halves every half-life after.
-- KEYS[1]: hash program -> attained service as of its last change; KEYS[2]: zset program -> that time
-- ARGV[1]: TTL in ms; ARGV[2]: half-life in s; ARGV[3]: most programs kept (least recently changed go);
-- ARGV[4]: n, the number of changes; ARGV[5 .. 4+2n]: program, tokens (a dispatch's cost or a
--   correction); the rest: programs to read
-- Returns a flat program/value list, every changed and read program's attained service now.
-- (fmt, num, fix, clock: policies/limits/preamble.lua: a value no script wrote reads as none)
local values, times = KEYS[1], KEYS[2]
fix('HLEN', values) -- a key of another type than this script writes is replaced before it is used
fix('ZCARD', times)
local now = clock('')
local half = tonumber(ARGV[2])
local function current(program)
  local value = num(redis.call('HGET', values, program), nil)
  if not value then return 0 end
  local t = redis.call('ZSCORE', times, program)
  if t then
    local dt = now - num(t, now)
    if dt > 0 then value = value * 0.5 ^ (dt / half) end
  end
  return value
end
local out = {}
local last = 4 + 2 * tonumber(ARGV[4])
for i = 5, last, 2 do
  local value = current(ARGV[i]) + tonumber(ARGV[i + 1])
  if value < 0 then value = 0 end
  redis.call('HSET', values, ARGV[i], fmt(value))
  redis.call('ZADD', times, fmt(now), ARGV[i])
  out[#out + 1] = ARGV[i]
  out[#out + 1] = fmt(value)
end
for i = last + 1, #ARGV do
  out[#out + 1] = ARGV[i]
  out[#out + 1] = fmt(current(ARGV[i]))
end
local excess = redis.call('ZCARD', times) - tonumber(ARGV[3])
if excess > 0 then
  local gone = redis.call('ZPOPMIN', times, excess)
  for i = 1, #gone, 2 do redis.call('HDEL', values, gone[i]) end
end
redis.call('PEXPIRE', values, ARGV[1])
redis.call('PEXPIRE', times, ARGV[1])
return out
