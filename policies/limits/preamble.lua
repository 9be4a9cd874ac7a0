-- tokenway: the helpers the Redis scripts share (the limiter's reserve, settle, void and peek, the flow
-- counters' vtc_batch), put in front of each script's text when it is loaded (`load_script` in
-- policies/limits/scriptpipe.py), so that each is defined once. Only local functions: a script's own names
-- cannot clash with anything outside it.

-- A number as the string that reads back as the same double.
local function fmt(x) return string.format('%.17g', x) end

-- What Redis holds is read as input: a replica of another version, a hand edit or a restore can leave
-- anything under the prefix (bench/chaos/state_fuzz.py). A stored number that is not one these scripts
-- write (text, NaN, an infinity) reads as `default`, so it cannot hold a limit open or shut, and the
-- next write replaces it.
local function num(v, default)
  local x = tonumber(v)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return default end
  return x
end

-- `redis.call(cmd, key, ...)`, the first command of a script on `key`: a key of another type than the
-- command's is deleted and the command run on the empty key, so one key holding what no script wrote
-- costs that key its state, not every request that script serves an error (a failed script trips
-- the limiter's breaker for everyone). Any other error is raised as `redis.call` raises it.
local function fix(cmd, key, ...)
  local r = redis.pcall(cmd, key, ...)
  if type(r) == 'table' and r.err then
    if not string.find(r.err, 'WRONGTYPE', 1, true) then error(r) end
    redis.call('DEL', key)
    return redis.call(cmd, key, ...)
  end
  return r
end

-- The script's clock: the caller's time when it passes one (tests), else Redis's own (TIME).
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A space-separated argument as a list of its words (the plan strings callers build once per plan).
local function words(s)
  local out = {}
  for tok in string.gmatch(s, '%S+') do out[#out + 1] = tok end
  return out
end

-- A space-separated argument as a list of numbers.
local function numbers(s)
  local out = {}
  for tok in string.gmatch(s, '%S+') do out[#out + 1] = tonumber(tok) end
  return out
end

-- A token bucket's use at `now`: `u` as of `t`, drained at `rate` per second since, never below zero
-- (the formula of policies/limits/memory_store.py).
local function drained(u, t, now, rate)
  if now > t then
    u = u - (now - t) * rate
    if u < 0 then u = 0 end
  end
  return u
end

-- Write a bucket's use as of the script's time, `stamp` (fmt(now), formatted once per script: a
-- number's 17 digits cost more than the command that carries them); it expires once it would have
-- drained to zero (plus a second).
-- A bucket that never drains (rate 0: an agent run's call or token cap) expires 32 days after its
-- last write, as a run's budget does. `covered`: the key exists and `u` is at most what it held as of
-- now (a refund), so the expiry set when it held more already comes after `u` has drained: the
-- PEXPIRE, a command per bucket, is left out (reads are the same either way: a drained bucket and a
-- missing one both read 0).
local function store_bucket(key, u, stamp, rate, covered)
  redis.call('HSET', key, 'u', fmt(u), 't', stamp)
  if rate > 0 then
    if not covered then redis.call('PEXPIRE', key, math.ceil(u / rate * 1000) + 1000) end
  else
    redis.call('PEXPIRE', key, 2764800000)
  end
end

-- Write a budget's spend `s` in period `pid` (a string). `fresh`: the key held another period (or
-- did not exist), so this write starts the period and sets the expiry, 2 days for a day's budget,
-- 32 days otherwise: longer than any period, so writes later in the same period need no EXPIRE of
-- their own (and leave the period id as it is). An agent run's budget (kind 'run', one period that
-- never ends) expires 32 days after its last write instead, so each of its writes sets it.
local function store_budget(key, pid, s, kind, fresh)
  if fresh then
    redis.call('HSET', key, 'p', pid, 's', fmt(s))
  else
    redis.call('HSET', key, 's', fmt(s))
  end
  if fresh or kind == 'run' then redis.call('EXPIRE', key, kind == 'day' and 172800 or 2764800) end
end

-- The budget period `now` falls in: the day number, for 'month' the month index y*12 + m-1 in UTC, for
-- 'billing:<day>:<offset>' the month index of the period that began on that day at 00:00 in the zone
-- (civil_from_days, H. Hinnant), as policies/limits/memory_store.py computes it.
local function period_id(kind, now)
  if kind == 'run' then return 0 end -- an agent run's budget: one period, never reset
  local anchor = 1
  if string.sub(kind, 1, 1) == 'b' then -- billing:<anchor day>:<UTC offset s>: the zone's wall clock
    local a, o = string.match(kind, '^billing:(%d+):(-?%d+)$')
    anchor = tonumber(a)
    now = now + tonumber(o)
  end
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
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  if d < anchor then return y * 12 + m - 2 end -- before the anchor: the period that began last month
  return y * 12 + m - 1
end

