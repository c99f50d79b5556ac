-- Fixed window, decided inside Redis on Redis's own clock (TIME).
--
-- KEYS[1]  a hash of one limited key: one field per rate, named by the
--          rate's window in µs, holding "<window index>:<count>"
-- ARGV[1]  cost: how many requests one request counts as
-- ARGV[2], ARGV[3], ...  max and window (µs) of each rate, in pairs
--
-- Returns {allowed (1/0), then per rate: remaining, reset µs, wait µs}.
--
-- Each rate counts the requests admitted in the current window of
-- wall-clock time, [index × window, (index + 1) × window) with
-- index = floor(now / window). A request is admitted if every rate has room
-- for its cost; only then does it count, in every rate. A denied request
-- writes nothing. The same semantics as src/store/memory/fixed_window.rs.
--
-- Numbers are Lua doubles, exact for integers up to 2^53: now (µs since the
-- epoch) is about 2^51, windows are at most ten years (about 2^48), counts
-- at most max (at most 2^53), so every value below is exact.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local key = KEYS[1]
local cost = tonumber(ARGV[1])
local nrates = (#ARGV - 1) / 2

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x)
  return string.format('%.0f', x)
end

-- floor(now / w), corrected for the rounding of the division (the products
-- are exact).
local function window_index(w)
  local index = math.floor(now / w)
  if index * w > now then
    index = index - 1
  elseif (index + 1) * w <= now then
    index = index + 1
  end
  return index
end

local names = {}
for i = 1, nrates do
  names[i] = ARGV[2 * i + 1]
end
local stored = redis.call('HMGET', key, unpack(names))

local indexes = {}
local counts = {}
local allowed = 1
for i = 1, nrates do
  local max = tonumber(ARGV[2 * i])
  local field = ARGV[2 * i + 1]
  local index = window_index(tonumber(field))
  local count = 0
  if stored[i] then
    local si, sc = string.match(stored[i], '^(%d+):(%d+)$')
    if si and tonumber(si) == index then
      count = tonumber(sc)
    end
  end
  indexes[i] = index
  counts[i] = count
  -- count + cost <= max, without forming a sum above 2^53 (cost <= max).
  if count > max - cost then
    allowed = 0
  end
end

local out = { allowed }
local expires_at = 0
local fields = {}
for i = 1, nrates do
  local max = tonumber(ARGV[2 * i])
  local field = ARGV[2 * i + 1]
  local w = tonumber(field)
  local finish = (indexes[i] + 1) * w
  local count = counts[i]
  local wait = 0
  if allowed == 1 then
    count = count + cost
  elseif count > max - cost then
    -- The counter starts again at the next window.
    wait = finish - now
  end
  local reset = 0
  if count > 0 then
    reset = finish - now
  end
  local remaining = max - count
  if remaining < 0 then
    remaining = 0
  end
  out[#out + 1] = int(remaining)
  out[#out + 1] = int(reset)
  out[#out + 1] = int(wait)
  if allowed == 1 then
    fields[#fields + 1] = field
    fields[#fields + 1] = int(indexes[i]) .. ':' .. int(count)
    if finish > expires_at then
      expires_at = finish
    end
  end
end

if allowed == 1 then
  redis.call('HSET', key, unpack(fields))
  -- The key disappears once the longest current window has ended. Never
  -- shorten it: fields of windows another policy counts on this key may
  -- need longer.
  local at = math.ceil(expires_at / 1000)
  local ttl = redis.call('PTTL', key)
  if ttl < 0 or math.floor(now / 1000) + ttl < at then
    redis.call('PEXPIREAT', key, int(at))
  end
end

return out
