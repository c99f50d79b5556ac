-- GCRA (token bucket), decided inside Redis on Redis's own clock (TIME).
-- The same IEEE double operations in the same order as
-- src/algorithm/gcra.rs, so both give the same answers. The arithmetic
-- works on the TAT's offset from now, where magnitudes are small: at today's
-- timestamps (~1.7e15 µs) a double only resolves 0.25 µs.
--
-- KEYS[1]  a hash of one limited key: field = window µs (decimal), value =
--          "<TAT whole µs> <TAT fraction>" (the fraction written with %.17g
--          so it reads back as the same double)
-- ARGV     cost of the request (tokens it takes from every rate); then max
--          and window (µs) of each rate, in pairs
--
-- All-or-nothing: an admitted request moves every TAT; a denied one writes
-- nothing. A penalty of u units moves every offset d to max(d, 0) + u·T
-- (at most twice the longest window, 20 years), a reward to
-- max(d, 0) − u·T (at least 0). The key expires once every TAT is in the
-- past.
local EPSILON = 1e-9
-- Twice the longest window (src/algorithm/gcra.rs).
local MAX_OFFSET = 632448000000000

local key = KEYS[1]
local cost = num(1)
local nrates = (nargs - 1) / 2

local fields = {}
for i = 1, nrates do
  fields[i] = arg(1 + 2 * i)
end

-- Round a positive number of µs up; zero otherwise.
local function micros_ceil(us)
  if us > 0 then
    return math.ceil(us)
  end
  return 0
end

-- Every rate's {max, w, T, d}: d is the TAT's offset from now, at least 0.
-- nil and an error reply for an unreadable TAT.
local function offsets()
  local stored = redis.call('HMGET', key, unpack(fields))
  local plans = {}
  for i = 1, nrates do
    local max = num(2 * i)
    local w = num(1 + 2 * i)
    local interval = w / max
    local offset = 0
    if stored[i] then
      local whole, frac = string.match(stored[i], '^(%d+) (%S+)$')
      whole = tonumber(whole)
      frac = tonumber(frac)
      if whole == nil or frac == nil then
        return nil, redis.error_reply('gcra: unreadable TAT in ' .. key .. ' field ' .. fields[i])
      end
      offset = (whole - now) + frac
    end
    local d = offset
    if d < 0 then
      d = 0
    end
    plans[i] = { max, w, interval, d }
  end
  return plans
end

-- The hash becomes exactly these offsets still ahead of now.
local function store(kepts)
  local writes = {}
  local latest = nil
  for i = 1, nrates do
    local kept = kepts[i]
    if kept > 0 then
      local whole = math.floor(kept)
      writes[#writes + 1] = fields[i]
      writes[#writes + 1] = string.format('%.0f', now + whole) .. ' ' .. string.format('%.17g', kept - whole)
      if latest == nil or kept > latest then
        latest = kept
      end
    end
  end
  redis.call('DEL', key)
  if latest ~= nil then
    redis.call('HSET', key, unpack(writes))
    local ttl = math.ceil(latest / 1000)
    if ttl < 1 then
      ttl = 1
    end
    redis.call('PEXPIRE', key, string.format('%.0f', ttl))
  end
end

-- Decide one request; `commit`: count it if admitted.
local function decide(commit)
  local plans, failure = offsets()
  if plans == nil then
    return failure
  end
  local allowed = 1
  for i = 1, nrates do
    local w, interval, d = plans[i][2], plans[i][3], plans[i][4]
    local new_d = d + cost * interval
    if not (new_d <= w * (1 + EPSILON)) then
      allowed = 0
    end
  end
  local out = { allowed, 0 }
  local kepts = {}
  for i = 1, nrates do
    local max, w, interval, d = unpack(plans[i])
    local new_d = d + cost * interval
    local kept = d
    if allowed == 1 then
      kept = new_d
    end
    kepts[i] = kept
    -- Tokens left now: how many more intervals fit in the window.
    local remaining = math.floor((w - kept) / interval + EPSILON)
    if remaining < 0 then
      remaining = 0
    end
    if remaining > max then
      remaining = max
    end
    local wait = 0
    if allowed == 0 and new_d > w * (1 + EPSILON) then
      -- Admitted once the offset has shrunk to the window.
      wait = micros_ceil(new_d - w)
    end
    out[#out + 1] = remaining
    out[#out + 1] = micros_ceil(kept)
    out[#out + 1] = wait
  end
  if allowed == 1 and commit then
    store(kepts)
  end
  return out
end

-- Move every rate's offset by `units` emission intervals (`sign` 1: a
-- penalty, up to MAX_OFFSET; -1: a reward, down to 0).
local function adjust(units, sign)
  local plans, failure = offsets()
  if plans == nil then
    return
  end
  local kepts = {}
  for i = 1, nrates do
    local kept = plans[i][4] + sign * units * plans[i][3]
    if kept > MAX_OFFSET then
      kept = MAX_OFFSET
    elseif kept < 0 then
      kept = 0
    end
    kepts[i] = kept
  end
  store(kepts)
end

local function penalty(units)
  adjust(units, 1)
end

local function reward(units)
  adjust(units, -1)
end
