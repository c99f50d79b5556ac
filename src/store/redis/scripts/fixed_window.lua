-- Fixed window, decided inside Redis on Redis's own clock (TIME), with the
-- semantics of src/algorithm/fixed_window.rs.
--
-- KEYS[1]  a hash of one limited key: one field per rate, named by the
--          rate's window in µs (a calendar rate's by its calendar,
--          'month:Europe/Paris:15'), holding "<window index>:<count>"
-- ARGV     cost: how many requests one request counts as; then max and
--          window (µs) of each rate, in pairs (a calendar rate's window:
--          its field's name and the boundaries around the client's time,
--          '<field>@<b1>,<b2>,...', read by the prelude)
--
-- Each rate counts the requests admitted in the current window of
-- wall-clock time, [index × window, (index + 1) × window) with
-- index = floor(now / window); a calendar rate's window is the one, among
-- the boundaries the client passed, that holds Redis's own time, and its
-- index is its start (µs). A request is admitted if every rate has room
-- for its cost; only then does it count, in every rate. A denied request
-- writes nothing. A penalty adds its units to every rate's count (at most
-- 2^53), a reward takes them off (never below zero).
--
-- Numbers are Lua doubles, exact for integers up to 2^53: now (µs since the
-- epoch) is about 2^51, windows are at most ten years (about 2^48), counts
-- at most 2^53, so every value below is exact.
-- The limited key and its policy, set by bind(): each policy's windows
-- are placed on the clock once per script call, however many keys it
-- checks.
local key, cost, nrates, names, maxes, indexes, finishes

-- Each rate's current window index and its end (µs). A calendar rate's
-- window is the one among its boundaries that holds now: a client whose
-- clock is more than a window away from Redis's passed none (an error).
local function place(policy)
  local windows, is, fs = policy[5], {}, {}
  for i = 1, policy[2] do
    local w = windows[i]
    if type(w) == 'table' then
      for j = 1, #w - 1 do
        if w[j] <= now and now < w[j + 1] then
          is[i], fs[i] = w[j], w[j + 1]
          break
        end
      end
      if not is[i] then
        error({ err = 'ERR calendar window ' .. policy[3][i] .. ': Redis time ' .. int(now)
          .. ' is outside the boundaries the client passed (its clock is a window away)' })
      end
    else
      is[i] = window_index(w)
      fs[i] = (is[i] + 1) * w
    end
  end
  policy[6], policy[7] = is, fs
end

local function bind(k)
  key = k
  local policy = policy_at(place)
  cost, nrates, names, maxes = policy[1], policy[2], policy[3], policy[4]
  indexes, finishes = policy[6], policy[7]
end

-- Every rate's count in its current window, and whether every rate's field
-- was last written in the current window (then the key's expiry already
-- covers it).
local function counters()
  local stored = redis.call('HMGET', key, unpack(names))
  local counts = {}
  local covered = true
  for i = 1, nrates do
    local count = 0
    local s = stored[i]
    if s then
      local si, sc = string.match(s, '^(%d+):(%d+)$')
      if si and tonumber(si) == indexes[i] then
        count = tonumber(sc)
      else
        covered = false
      end
    else
      covered = false
    end
    counts[i] = count
  end
  return counts, covered
end

-- Write every rate's count (a zero count removes its field). The key
-- disappears once the longest current window has ended; never shorten it:
-- fields of windows another policy counts on this key may need longer.
-- `covered`: the expiry is known to be long enough already.
local function store(counts, covered)
  local fields, gone = {}, {}
  local expires_at = 0
  for i = 1, nrates do
    if counts[i] > 0 then
      fields[#fields + 1] = names[i]
      -- Indexes and counts are integers below 2^53: '%d' is exact.
      fields[#fields + 1] = string.format('%d:%d', indexes[i], counts[i])
      if finishes[i] > expires_at then
        expires_at = finishes[i]
      end
    else
      gone[#gone + 1] = names[i]
    end
  end
  write_fields(key, fields, gone, expires_at, covered)
end

-- Decide one request; `commit`: count it if admitted.
local function decide(commit)
  local counts, covered = counters()
  local allowed = 1
  for i = 1, nrates do
    -- count + cost <= max, without forming a sum above 2^53 (cost <= max).
    if counts[i] > maxes[i] - cost then
      allowed = 0
    end
  end
  local out = { allowed, 0 }
  local o = 2
  for i = 1, nrates do
    local max = maxes[i]
    local finish = finishes[i]
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
    out[o + 1] = remaining
    out[o + 2] = reset
    out[o + 3] = wait
    o = o + 3
  end
  if allowed == 1 and commit then
    -- An admitted count is positive: no field is removed, and a field
    -- counted in the current window already has the expiry it needs.
    store(counts, covered)
  end
  return out
end

local function penalty(units)
  local counts = counters()
  for i = 1, nrates do
    counts[i] = math.min(counts[i] + units, MAX_COUNT)
  end
  store(counts)
end

local function reward(units)
  local counts = counters()
  for i = 1, nrates do
    counts[i] = math.max(counts[i] - units, 0)
  end
  store(counts)
end
