-- Sliding window counter, decided inside Redis on Redis's own clock (TIME),
-- with the semantics of src/algorithm/sliding_window.rs.
--
-- KEYS[1]  a hash of one limited key: one field per rate, named by the
--          rate's window in µs, holding
--          "<window index>:<current count>:<previous count>"
-- ARGV     cost: how many requests one request counts as; then max and
--          window (µs) of each rate, in pairs
--
-- At `elapsed` µs into the current window, a request of cost c is admitted
-- if, for every rate, previous × (window − elapsed) + (current + c) × window
-- ≤ max × window (checked below in the equivalent form
-- previous × (window − elapsed) ≤ (max − current − c) × window).
-- Only an admitted request counts, in every rate; a denied one writes
-- nothing. A penalty adds its units to every rate's current count (at most
-- 2^53); a reward takes them off the current count, the rest off the
-- previous one (never below zero).
--
-- Precision: Redis's Lua computes in doubles, not in the 128-bit integers of
-- the memory store. now (µs since the epoch, about 2^51), windows (at most
-- ten years, about 2^48) and counts (at most 2^53) are exact, and so is
-- every product, quotient and floor below as long as max × window (µs) is
-- at most 2^53 (e.g. 1000 per day, or 10^7 per 15 minutes). Beyond that the
-- weighted products are rounded to 53 bits (relative error about 2^-52):
-- the decision can differ from the memory store's within one microsecond of
-- the exact boundary, the wait by one microsecond, and remaining by a
-- request or two (out of a max near 2^53). A rate's own count (no previous
-- window) is always compared exactly.
-- The limited key and its policy, set by bind(): each policy's windows
-- are placed on the clock once per script call, however many keys it
-- checks.
local key, cost, nrates, names, maxes, windows, indexes

-- Each rate's current window index.
local function place(policy)
  local is = {}
  for i = 1, policy[2] do
    is[i] = window_index(policy[5][i])
  end
  policy[6] = is
end

local function bind(k)
  key = k
  local policy = policy_at(place)
  cost, nrates, names, maxes, windows = policy[1], policy[2], policy[3], policy[4], policy[5]
  indexes = policy[6]
end

-- Whether `c` more fits at `elapsed` into the window.
local function fits(prev, cur, elapsed, w, c, max)
  local room = max - cur - c
  if room < 0 then
    return false
  end
  if prev == 0 then
    return true
  end
  return prev * (w - elapsed) <= room * w
end

-- The smallest integer elapsed at which prev × (w − elapsed) ≤ room × w:
-- w − floor(room × w / prev).
local function elapsed_needed(prev, w, room)
  if prev == 0 then
    return 0
  end
  local needed = w - math.floor(room * w / prev)
  if needed < 0 then
    return 0
  end
  return needed
end

-- Time from now until a request of cost `c` fits, with no other request.
local function wait_for(prev, cur, elapsed, w, c, max)
  -- In this window, once enough of the previous one has slid out.
  if cur <= max - c then
    local needed = elapsed_needed(prev, w, max - cur - c)
    if needed < w then
      if needed > elapsed then
        return needed - elapsed
      end
      return 0
    end
  end
  -- In the next window, where this window's count becomes the previous one.
  return (w - elapsed) + elapsed_needed(cur, w, max - c)
end

-- Every rate's counters rolled forward to the window holding now:
-- indexes, currents, previouses, elapseds; and whether every rate's field
-- was last written in the current window with a current count (then the
-- key's expiry, the end of the next window, already covers it).
local function counters()
  local stored = redis.call('HMGET', key, unpack(names))
  local currents, previouses, elapseds = {}, {}, {}
  local covered = true
  for i = 1, nrates do
    local w = windows[i]
    local index = indexes[i]
    local cur, prev = 0, 0
    if stored[i] then
      local si, sc, sp = string.match(stored[i], '^(%d+):(%d+):(%d+)$')
      if si then
        si = tonumber(si)
        if si == index then
          cur, prev = tonumber(sc), tonumber(sp)
        elseif si + 1 == index then
          cur, prev = 0, tonumber(sc)
        end
      end
    end
    if cur == 0 then
      covered = false
    end
    currents[i] = cur
    previouses[i] = prev
    elapseds[i] = now - index * w
  end
  return indexes, currents, previouses, elapseds, covered
end

-- µs until the estimate is back to zero: when both counted windows have
-- slid out.
local function reset_of(index, w, cur, prev)
  local finish = (index + 1) * w
  if cur > 0 then
    return finish + w - now
  elseif prev > 0 then
    return finish - now
  end
  return 0
end

-- Write every rate's counters (none left removes its field). The key
-- disappears once both counted windows of every rate have slid out; never
-- shorten it: fields of windows another policy counts on this key may need
-- longer. `covered`: the expiry is known to be long enough already.
local function store(indexes, currents, previouses, covered)
  local fields, gone = {}, {}
  local expires_at = 0
  for i = 1, nrates do
    local cur, prev = currents[i], previouses[i]
    if cur > 0 or prev > 0 then
      fields[#fields + 1] = names[i]
      -- Indexes and counts are integers below 2^53: '%d' is exact.
      fields[#fields + 1] = string.format('%d:%d:%d', indexes[i], cur, prev)
      local at = now + reset_of(indexes[i], windows[i], cur, prev)
      if at > expires_at then
        expires_at = at
      end
    else
      gone[#gone + 1] = names[i]
    end
  end
  write_fields(key, fields, gone, expires_at, covered)
end

-- Decide one request; `commit`: count it if admitted.
local function decide(commit)
  local indexes, currents, previouses, elapseds, covered = counters()
  local allowed = 1
  for i = 1, nrates do
    if not fits(previouses[i], currents[i], elapseds[i], windows[i], cost, maxes[i]) then
      allowed = 0
    end
  end
  local out = { allowed, 0 }
  for i = 1, nrates do
    local max = maxes[i]
    local w = windows[i]
    local cur, prev, elapsed = currents[i], previouses[i], elapseds[i]
    local wait = 0
    if allowed == 0 and not fits(prev, cur, elapsed, w, cost, max) then
      wait = wait_for(prev, cur, elapsed, w, cost, max)
    end
    if allowed == 1 then
      cur = cur + cost
      currents[i] = cur
    end
    -- Requests that still fit now:
    -- floor((max × w − prev × (w − elapsed)) / w) − cur
    -- = max − ceil(prev × (w − elapsed) / w) − cur, at least 0.
    local remaining = max - math.ceil(prev * (w - elapsed) / w)
    if remaining < 0 then
      remaining = 0
    end
    remaining = remaining - cur
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = remaining
    out[#out + 1] = reset_of(indexes[i], w, cur, prev)
    out[#out + 1] = wait
  end
  if allowed == 1 and commit then
    store(indexes, currents, previouses, covered)
  end
  return out
end

local function penalty(units)
  local indexes, currents, previouses = counters()
  for i = 1, nrates do
    currents[i] = math.min(currents[i] + units, MAX_COUNT)
  end
  store(indexes, currents, previouses)
end

local function reward(units)
  local indexes, currents, previouses = counters()
  for i = 1, nrates do
    local from_current = math.min(units, currents[i])
    currents[i] = currents[i] - from_current
    previouses[i] = math.max(previouses[i] - (units - from_current), 0)
  end
  store(indexes, currents, previouses)
end
