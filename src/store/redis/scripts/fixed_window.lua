-- Fixed window, decided inside Redis on Redis's own clock (TIME), with the
-- semantics of src/algorithm/fixed_window.rs.
--
-- KEYS[1]  a hash of one limited key: one field per rate, named by the
--          rate's window in µs, holding "<window index>:<count>"
-- ARGV     cost: how many requests one request counts as; then max and
--          window (µs) of each rate, in pairs
--
-- Each rate counts the requests admitted in the current window of
-- wall-clock time, [index × window, (index + 1) × window) with
-- index = floor(now / window). A request is admitted if every rate has room
-- for its cost; only then does it count, in every rate. A denied request
-- writes nothing. A penalty adds its units to every rate's count (at most
-- 2^53), a reward takes them off (never below zero).
--
-- Numbers are Lua doubles, exact for integers up to 2^53: now (µs since the
-- epoch) is about 2^51, windows are at most ten years (about 2^48), counts
-- at most 2^53, so every value below is exact.
local key = KEYS[1]
local cost = num(1)
local nrates = (nargs - 1) / 2

local names = {}
for i = 1, nrates do
  names[i] = arg(2 * i + 1)
end

-- Every rate's window index and count in that window.
local function counters()
  local stored = redis.call('HMGET', key, unpack(names))
  local indexes, counts = {}, {}
  for i = 1, nrates do
    local index = window_index(tonumber(names[i]))
    local count = 0
    if stored[i] then
      local si, sc = string.match(stored[i], '^(%d+):(%d+)$')
      if si and tonumber(si) == index then
        count = tonumber(sc)
      end
    end
    indexes[i] = index
    counts[i] = count
  end
  return indexes, counts
end

-- Write every rate's count (a zero count removes its field). The key
-- disappears once the longest current window has ended; never shorten it:
-- fields of windows another policy counts on this key may need longer.
local function store(indexes, counts)
  local fields, gone = {}, {}
  local expires_at = 0
  for i = 1, nrates do
    if counts[i] > 0 then
      fields[#fields + 1] = names[i]
      fields[#fields + 1] = int(indexes[i]) .. ':' .. int(counts[i])
      local finish = (indexes[i] + 1) * tonumber(names[i])
      if finish > expires_at then
        expires_at = finish
      end
    else
      gone[#gone + 1] = names[i]
    end
  end
  write_fields(key, fields, gone, expires_at)
end

-- Decide one request; `commit`: count it if admitted.
local function decide(commit)
  local indexes, counts = counters()
  local allowed = 1
  for i = 1, nrates do
    -- count + cost <= max, without forming a sum above 2^53 (cost <= max).
    if counts[i] > num(2 * i) - cost then
      allowed = 0
    end
  end
  local out = { allowed, 0 }
  for i = 1, nrates do
    local max = num(2 * i)
    local w = tonumber(names[i])
    local finish = (indexes[i] + 1) * w
    local count = counts[i]
    local wait = 0
    if allowed == 1 then
      count = count + cost
    elseif count > max - cost then
      -- The counter starts again at the next window.
      wait = finish - now
    end
    counts[i] = count
    local reset = 0
    if count > 0 then
      reset = finish - now
    end
    local remaining = max - count
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = remaining
    out[#out + 1] = reset
    out[#out + 1] = wait
  end
  if allowed == 1 and commit then
    store(indexes, counts)
  end
  return out
end

local function penalty(units)
  local indexes, counts = counters()
  for i = 1, nrates do
    counts[i] = math.min(counts[i] + units, MAX_COUNT)
  end
  store(indexes, counts)
end

local function reward(units)
  local indexes, counts = counters()
  for i = 1, nrates do
    counts[i] = math.max(counts[i] - units, 0)
  end
  store(indexes, counts)
end
