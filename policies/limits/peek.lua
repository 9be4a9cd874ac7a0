-- tokenway: read one plan's state without charging anything (the caller's standing, GET /v1/key).
-- Same layout as reserve.lua: KEYS [1] tickets zset (unused), nb bucket hashes, nl lease zsets, nu
-- budget hashes; ARGV [1] now ('' = TIME) [2] the plan string of reserve.lua.
-- Returns {now, used x nb, active x nl, spent x nu, period x nu} as strings.

local function fmt(x) return string.format('%.17g', x) end

local function period_id(kind, now)
  local days = math.floor(now / 86400)
  if kind == 'day' then return days end
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y * 12 + m - 1
end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local plan = {}
for tok in string.gmatch(ARGV[2], '%S+') do plan[#plan + 1] = tok end
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])
local out = {fmt(now)}
local a = 4
for i = 1, nb do
  local rate = tonumber(plan[a + 1])
  a = a + 3
  local st = redis.call('HMGET', KEYS[1 + i], 'u', 't')
  local u = tonumber(st[1]) or 0
  local t = tonumber(st[2]) or now
  if now > t then
    u = u - (now - t) * rate
    if u < 0 then u = 0 end
  end
  out[#out + 1] = fmt(u)
end
for i = 1, nl do
  a = a + 2
  out[#out + 1] = tostring(redis.call('ZCOUNT', KEYS[1 + nb + i], '(' .. fmt(now), '+inf'))
end
local periods = {}
for i = 1, nu do
  local kind = plan[a + 1]
  a = a + 3
  local pid = period_id(kind, now)
  local st = redis.call('HMGET', KEYS[1 + nb + nl + i], 'p', 's')
  local s = 0
  if tonumber(st[1]) == pid then s = tonumber(st[2]) or 0 end
  out[#out + 1] = fmt(s)
  periods[i] = pid
end
for i = 1, nu do out[#out + 1] = tostring(periods[i]) end
return out
