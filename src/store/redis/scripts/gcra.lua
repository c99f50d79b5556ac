-- GCRA (token bucket), decided inside Redis on Redis's own clock (TIME).
-- The same IEEE double operations in the same order as the memory store
-- (src/store/memory/gcra.rs), so both give the same answers. The arithmetic
-- works on the TAT's offset from now, where magnitudes are small: at today's
-- timestamps (~1.7e15 µs) a double only resolves 0.25 µs.
--
-- KEYS[1]  a hash of one limited key: field = window µs (decimal), value =
--          "<TAT whole µs> <TAT fraction>" (the fraction written with %.17g
--          so it reads back as the same double)
-- ARGV[1]  cost of the request (tokens it takes from every rate)
-- ARGV[2], ARGV[3], ...  max and window (µs) of each rate, in pairs
--
-- Returns {allowed (1/0), then per rate: remaining, reset µs, wait µs}.
-- All-or-nothing: an admitted request moves every TAT; a denied one writes
-- nothing. The key expires once every TAT is in the past.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local EPSILON = 1e-9

local key = KEYS[1]
local cost = tonumber(ARGV[1])
local nrates = (#ARGV - 1) / 2

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local fields = {}
for i = 1, nrates do
  fields[i] = ARGV[1 + 2 * i]
end
local stored = redis.call('HMGET', key, unpack(fields))

-- Round a positive number of µs up; zero otherwise.
local function micros_ceil(us)
  if us > 0 then
    return math.ceil(us)
  end
  return 0
end

local allowed = 1
local plans = {}
for i = 1, nrates do
  local max = tonumber(ARGV[2 * i])
  local w = tonumber(ARGV[1 + 2 * i])
  local interval = w / max
  local offset = 0
  if stored[i] then
    local whole, frac = string.match(stored[i], '^(%d+) (%S+)$')
    whole = tonumber(whole)
    frac = tonumber(frac)
    if whole == nil or frac == nil then
      return redis.error_reply('gcra: unreadable TAT in ' .. key .. ' field ' .. fields[i])
    end
    offset = (whole - now) + frac
  end
  local d = offset
  if d < 0 then
    d = 0
  end
  local new_d = d + cost * interval
  if not (new_d <= w * (1 + EPSILON)) then
    allowed = 0
  end
  plans[i] = { max, w, interval, d, new_d }
end

local out = { allowed }
local writes = {}
local latest = nil
for i = 1, nrates do
  local max, w, interval, d, new_d = unpack(plans[i])
  local kept = d
  if allowed == 1 then
    kept = new_d
  end
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
  if kept > 0 then
    local whole = math.floor(kept)
    writes[#writes + 1] = fields[i]
    writes[#writes + 1] = string.format('%.0f', now + whole) .. ' ' .. string.format('%.17g', kept - whole)
    if latest == nil or kept > latest then
      latest = kept
    end
  end
end

if allowed == 1 then
  -- The hash becomes exactly this policy's TATs still ahead of now.
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

return out
