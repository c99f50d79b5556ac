-- Fixed window, decided inside Redis on Redis's own clock (TIME), with the
-- semantics of src/algorithm/fixed_window.rs.
--
-- KEYS[1]  the name of one limited key's counts: each rate's count in its
--          current window is a plain integer at
--          '<KEYS[1]>:<field>:<window index>' (the same hash tag, so the
--          same cluster slot), where the field is the rate's window in µs
--          (a calendar rate's: its calendar, 'month:Europe/Paris:15'); it
--          expires when its window ends
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
-- for its cost; only then does it count, in every rate. A penalty adds its
-- units to every rate's count (at most 2^53), a reward takes them off
-- (never below zero; a count of zero is no key).
--
-- A check reads the counts and counts only when it is admitted, atomically:
-- a denied request writes nothing (its batched checks mostly are denials:
-- batched admissions go as plain commands, src/store/redis/plain.rs).
--
-- Numbers are Lua doubles, exact for integers up to 2^53: now (µs since the
-- epoch) is about 2^51, windows are at most ten years (about 2^48), counts
-- at most 2^53 (Redis's own integers are exact beyond), so every value
-- below is exact.
-- The limited key and its policy, set by bind(): each policy's windows
-- are placed on the clock once per script call, however many keys it
-- checks.
local key, cost, cost_text, nrates, names, maxes, finishes, suffixes, expiries

-- Each rate's current window: its end (µs), its expiry (ms, for
-- PEXPIREAT) and the suffix of its count's key. A calendar rate's window
-- is the one among its boundaries that holds now: a client whose clock is
-- more than a window away from Redis's passed none (an error).
local function place(policy)
  local windows, fs, ss, es = policy[5], {}, {}, {}
  for i = 1, policy[2] do
    local w = windows[i]
    local index
    if type(w) == 'table' then
      for j = 1, #w - 1 do
        if w[j] <= now and now < w[j + 1] then
          index, fs[i] = w[j], w[j + 1]
          break
        end
      end
      if not index then
        error({ err = 'ERR calendar window ' .. policy[3][i] .. ': Redis time ' .. int(now)
          .. ' is outside the boundaries the client passed (its clock is a window away)' })
      end
    else
      index = window_index(w)
      fs[i] = (index + 1) * w
    end
    ss[i] = ':' .. policy[3][i] .. ':' .. int(index)
    es[i] = int(math.ceil(fs[i] / 1000))
  end
  policy[6], policy[7], policy[8], policy[9] = fs, ss, es, int(policy[1])
end

local function bind(k)
  key = k
  local policy = policy_at(place)
  cost, nrates, names, maxes = policy[1], policy[2], policy[3], policy[4]
  finishes, suffixes, expiries, cost_text = policy[6], policy[7], policy[8], policy[9]
end

-- Every rate's current count (and what a reset deletes besides KEYS[1]
-- and the block).
local function state_keys()
  local ks = {}
  for i = 1, nrates do
    ks[i] = key .. suffixes[i]
  end
  return ks
end

-- The reply of a decision on `counts` (after it).
local function reply(allowed, counts)
  local out = { allowed, 0 }
  local o = 2
  for i = 1, nrates do
    local max, count = maxes[i], counts[i]
    local left = finishes[i] - now
    local wait = 0
    -- The counter starts again at the next window.
    if allowed == 0 and count > max - cost then
      wait = left
    end
    local reset = 0
    if count > 0 then
      reset = left
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
  return out
end

-- Decide one request; `commit`: count it if admitted (a peek does not).
-- Counted only when admitted (atomic with the read: the script is), so a
-- denial writes nothing.
local function decide(commit)
  local ks = state_keys()
  local counts = read_counts(ks)
  local allowed = 1
  for i = 1, nrates do
    -- count + cost <= max, without forming a sum above 2^53 (cost <= max).
    if counts[i] > maxes[i] - cost then
      allowed = 0
    end
  end
  if allowed == 1 then
    if commit then
      counts = add_counts(ks, expiries, cost, cost_text)
    else
      -- Answered as the request would be: admitted, it counts.
      for i = 1, nrates do
        counts[i] = counts[i] + cost
      end
    end
  end
  return reply(allowed, counts)
end

local function penalty(units)
  local text = int(units)
  for i = 1, nrates do
    -- (A count past 2^53 reads back rounded: at 2^53 or more, it is set.)
    if add_count(key .. suffixes[i], units, text, expiries[i]) >= MAX_COUNT then
      redis.call('SET', key .. suffixes[i], int(MAX_COUNT), 'KEEPTTL')
    end
  end
end

local function reward(units)
  local text = int(units)
  for i = 1, nrates do
    local k = key .. suffixes[i]
    if redis.call('DECRBY', k, text) <= 0 then
      redis.call('DEL', k)
    end
  end
end

