-- Sliding window counter, decided inside Redis on Redis's own clock (TIME),
-- with the semantics of src/algorithm/sliding_window.rs.
--
-- KEYS[1]  the name of one limited key's counts: each rate's count of a
--          window is a plain integer at '<KEYS[1]>:<window µs>:<window index>'
--          (the same hash tag, so the same cluster slot); it expires when
--          the window after it ends, when it stops counting
-- ARGV     cost: how many requests one request counts as; then max and
--          window (µs) of each rate, in pairs
--
-- At `elapsed` µs into the current window, a request of cost c is admitted
-- if, for every rate, previous × (window − elapsed) + (current + c) × window
-- ≤ max × window (checked below in the equivalent form
-- previous × (window − elapsed) ≤ (max − current − c) × window).
-- Only an admitted request counts, in every rate: a check reads the counts
-- and, admitted, adds to the current window's (INCRBY), atomically; a
-- denied request writes nothing. A
-- penalty adds its units to every rate's current count (at most 2^53); a
-- reward takes them off the current count, the rest off the previous one
-- (never below zero; a count of zero is no key).
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
-- window) is always compared exactly. (The batches of plain commands decide
-- in Rust, in 128-bit integers: exactly.)
-- The limited key and its policy, set by bind(): each policy's windows
-- are placed on the clock once per script call, however many keys it
-- checks.
local key, cost, cost_text, nrates, maxes, windows, indexes, currents_at, previouses_at, expiries

-- Each rate's current window index, the suffixes of its current and
-- previous counts' keys, and the current count's expiry (ms: the end of
-- the next window).
local function place(policy)
  local is, cs, ps, es = {}, {}, {}, {}
  for i = 1, policy[2] do
    local w = policy[5][i]
    is[i] = window_index(w)
    cs[i] = ':' .. policy[3][i] .. ':' .. int(is[i])
    ps[i] = ':' .. policy[3][i] .. ':' .. int(is[i] - 1)
    es[i] = int(math.ceil((is[i] + 2) * w / 1000))
  end
  policy[6], policy[7], policy[8], policy[9], policy[10] = is, cs, ps, es, int(policy[1])
end

local function bind(k)
  key = k
  local policy = policy_at(place)
  cost, nrates, maxes, windows = policy[1], policy[2], policy[4], policy[5]
  indexes, currents_at, previouses_at = policy[6], policy[7], policy[8]
  expiries, cost_text = policy[9], policy[10]
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

-- Every rate's current and previous counts.
local function counters()
  local ks = {}
  for i = 1, nrates do
    ks[2 * i - 1] = key .. currents_at[i]
    ks[2 * i] = key .. previouses_at[i]
  end
  local counts = read_counts(ks)
  local currents, previouses = {}, {}
  for i = 1, nrates do
    currents[i], previouses[i] = counts[2 * i - 1], counts[2 * i]
  end
  return currents, previouses
end

-- Set rate i's count at `suffix` to `count` (no key at zero), keeping its
-- expiry.
local function set(suffix, count)
  local k = key .. suffix
  if count > 0 then
    redis.call('SET', k, int(count), 'KEEPTTL')
  else
    redis.call('DEL', k)
  end
end

-- The reply of a decision on the counts (the current ones after it).
local function reply(allowed, currents, previouses, denies)
  local out = { allowed, 0 }
  for i = 1, nrates do
    local max = maxes[i]
    local w = windows[i]
    local cur, prev = currents[i], previouses[i]
    local elapsed = now - indexes[i] * w
    local wait = 0
    if denies[i] then
      wait = wait_for(prev, cur, elapsed, w, cost, max)
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
  return out
end

-- Decide one request; `commit`: count it if admitted (a peek does not).
local function decide(commit)
  local currents, previouses = counters()
  local allowed = 1
  local denies = {}
  for i = 1, nrates do
    local elapsed = now - indexes[i] * windows[i]
    denies[i] = not fits(previouses[i], currents[i], elapsed, windows[i], cost, maxes[i])
    if denies[i] then
      allowed = 0
    end
  end
  if allowed == 1 then
    -- Counted only when admitted (atomic with the read: the script is), so
    -- a denial writes nothing.
    if commit then
      local ks = {}
      for i = 1, nrates do
        ks[i] = key .. currents_at[i]
      end
      add_counts(ks, expiries, cost, cost_text)
    end
    -- Answered as the request would be: admitted, it counts.
    for i = 1, nrates do
      currents[i] = currents[i] + cost
      denies[i] = false
    end
  end
  return reply(allowed, currents, previouses, denies)
end

local function penalty(units)
  local text = int(units)
  for i = 1, nrates do
    -- (A count past 2^53 reads back rounded: at 2^53 or more, it is set.)
    if add_count(key .. currents_at[i], units, text, expiries[i]) >= MAX_COUNT then
      redis.call('SET', key .. currents_at[i], int(MAX_COUNT), 'KEEPTTL')
    end
  end
end

local function reward(units)
  local currents, previouses = counters()
  for i = 1, nrates do
    local from_current = math.min(units, currents[i])
    set(currents_at[i], currents[i] - from_current)
    set(previouses_at[i], math.max(previouses[i] - (units - from_current), 0))
  end
end

-- The keys a reset deletes besides KEYS[1] and the block: every rate's
-- current and previous counts.
local function state_keys()
  local ks = {}
  for i = 1, nrates do
    ks[#ks + 1] = key .. currents_at[i]
    ks[#ks + 1] = key .. previouses_at[i]
  end
  return ks
end
