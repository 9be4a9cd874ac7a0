-- One gateway process's adapter activity on one pool since its last call, and a read of the fleet's
-- (gateway/transport/lora_shared.py). The pool's hash holds four kinds of fields:
--   'u|' endpoint '\31' adapter -> when the adapter was last used on that endpoint (Redis's clock)
--   'd|' adapter                -> requests for the adapter on the pool, every process's, since the hash began
--   'l'                         -> on-demand loads on the pool's replicas, likewise
--   'a|' endpoint '\31' kind    -> what the gateways did with adapters on that replica (loads, preloads,
--                                  evictions, unloads, failures), likewise
-- Processes send ages, not times, so their clocks never meet: a use `age` seconds ago is stamped
-- now - age, and read back as an age.
-- KEYS[1]: the pool's hash. ARGV[1]: TTL in ms; ARGV[2]: most fields kept; ARGV[3]: a last use older
-- than this many seconds is dropped; ARGV[4]: the time ('' : Redis's own; tests pass one); ARGV[5]: n,
-- the number of uses; ARGV[6 .. 5+2n]: field, age; the rest: field, count to add.
-- Returns a flat field/value list of the whole hash: ages for 'u|' fields, totals for the others.
-- (fmt, clock: policies/limits/preamble.lua)
local key = KEYS[1]
local now = clock(ARGV[4])
local cap = tonumber(ARGV[2])
local keep = tonumber(ARGV[3])
local size = redis.call('HLEN', key)
local last = 5 + 2 * tonumber(ARGV[5])
for i = 6, last, 2 do
  local stamp = now - tonumber(ARGV[i + 1])
  local old = redis.call('HGET', key, ARGV[i])
  if old then
    if tonumber(old) < stamp then redis.call('HSET', key, ARGV[i], fmt(stamp)) end
  elseif size < cap then
    redis.call('HSET', key, ARGV[i], fmt(stamp))
    size = size + 1
  end
end
for i = last + 1, #ARGV, 2 do
  local known = redis.call('HEXISTS', key, ARGV[i]) == 1
  if known or size < cap then
    redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
    if not known then size = size + 1 end
  end
end
local out = {}
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local field, value = all[i], all[i + 1]
  if string.sub(field, 1, 2) == 'u|' then
    local age = now - tonumber(value)
    if age > keep then
      redis.call('HDEL', key, field)
    else
      if age < 0 then age = 0 end
      out[#out + 1] = field
      out[#out + 1] = fmt(age)
    end
  else
    out[#out + 1] = field
    out[#out + 1] = value
  end
end
if #all > 0 then redis.call('PEXPIRE', key, ARGV[1]) end
return out
