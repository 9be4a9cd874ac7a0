-- tokenway: read one plan's state without charging anything (the caller's standing, GET /v1/key).
-- Same layout as reserve.lua: KEYS [1] tickets zset (unused), nb bucket hashes, nl lease zsets, nu
-- budget hashes; ARGV [1] now ('' = TIME) [2] the plan string of reserve.lua.
-- Returns {now, used x nb, active x nl, spent x nu, period x nu} as strings.
-- (fmt, num, clock, words, numbers, drained, store_bucket, period_id: policies/limits/preamble.lua)

local now = clock(ARGV[1])
local plan = words(ARGV[2])
local nb, nl, nu = tonumber(plan[1]), tonumber(plan[2]), tonumber(plan[3])
local out = {fmt(now)}
local a = 4
for i = 1, nb do
  local rate = tonumber(plan[a + 1])
  a = a + 3
  local st = redis.pcall('HMGET', KEYS[1 + i], 'u', 't')  -- a read: a key of another type reads as empty
  if st.err then st = {false, false} end
  out[#out + 1] = fmt(drained(num(st[1], 0), num(st[2], now), now, rate))
end
for i = 1, nl do
  a = a + 2
  local n = redis.pcall('ZCOUNT', KEYS[1 + nb + i], '(' .. fmt(now), '+inf')
  out[#out + 1] = tostring(type(n) == 'number' and n or 0)
end
local periods = {}
for i = 1, nu do
  local kind = plan[a + 1]
  a = a + 3
  local pid = period_id(kind, now)
  local st = redis.pcall('HMGET', KEYS[1 + nb + nl + i], 'p', 's')
  if st.err then st = {false, false} end
  local s = 0
  if num(st[1], nil) == pid then s = num(st[2], 0) end
  out[#out + 1] = fmt(s)
  periods[i] = pid
end
for i = 1, nu do out[#out + 1] = tostring(periods[i]) end
return out
