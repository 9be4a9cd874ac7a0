-- One tenant's virtual token counter in one (pool, band), changed atomically (policies/flow/vtc.py).
-- KEYS[1]: hash tenant -> counter; KEYS[2]: the counter of the tenant dispatched last
-- ARGV[1]: tenant; ARGV[2]: lift to this floor ('' = no lift); ARGV[3]: delta to add;
-- ARGV[4]: '1' when this is a dispatch (it becomes the band's last served); ARGV[5]: TTL in ms;
-- ARGV[6]: credit (held-back refunds, <= 0) taken off before the delta, never below the floor of ARGV[2]
-- Returns {last served, counters as a flat field/value list}: the caller's view of the whole band.
local counters, last = KEYS[1], KEYS[2]
local tenant = ARGV[1]
local value = tonumber(redis.call('HGET', counters, tenant) or '0')
local changed = false
local floor = nil
if ARGV[2] ~= '' then
  floor = tonumber(ARGV[2])
  if floor > value then
    value = floor
    changed = true
  end
end
local credit = tonumber(ARGV[6] or '0')
if credit ~= 0 then
  value = value + credit
  if floor ~= nil and value < floor then
    value = floor
  end
  changed = true
end
if changed then
  redis.call('HSET', counters, tenant, string.format('%.17g', value))
end
if ARGV[4] == '1' then
  redis.call('SET', last, string.format('%.17g', value), 'PX', ARGV[5])
end
if tonumber(ARGV[3]) ~= 0 then
  redis.call('HINCRBYFLOAT', counters, tenant, ARGV[3])
end
redis.call('PEXPIRE', counters, ARGV[5])
return {redis.call('GET', last) or '0', redis.call('HGETALL', counters)}
