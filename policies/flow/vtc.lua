-- One tenant's virtual token counter in one (pool, band), changed atomically (policies/flow/vtc.py).
-- KEYS[1]: hash tenant -> counter; KEYS[2]: the counter of the tenant dispatched last
-- ARGV[1]: tenant; ARGV[2]: lift to this floor ('' = no lift); ARGV[3]: delta to add;
-- ARGV[4]: '1' when this is a dispatch (it becomes the band's last served); ARGV[5]: TTL in ms
-- Returns {last served, counters as a flat field/value list}: the caller's view of the whole band.
local counters, last = KEYS[1], KEYS[2]
local tenant = ARGV[1]
local value = tonumber(redis.call('HGET', counters, tenant) or '0')
if ARGV[2] ~= '' then
  local floor = tonumber(ARGV[2])
  if floor > value then
    value = floor
    redis.call('HSET', counters, tenant, ARGV[2])
  end
end
if ARGV[4] == '1' then
  redis.call('SET', last, string.format('%.17g', value), 'PX', ARGV[5])
end
if tonumber(ARGV[3]) ~= 0 then
  redis.call('HINCRBYFLOAT', counters, tenant, ARGV[3])
end
redis.call('PEXPIRE', counters, ARGV[5])
return {redis.call('GET', last) or '0', redis.call('HGETALL', counters)}
