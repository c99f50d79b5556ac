-- GCRA (token bucket), decided inside Redis on Redis's own clock (TIME).
-- The same IEEE double operations in the same order as
-- src/algorithm/gcra.rs, so both give the same answers. The arithmetic
-- works on the TAT's offset from now, where magnitudes are small: at today's
-- timestamps (~1.7e15 µs) a double only resolves 0.25 µs.
--
-- KEYS[1]  a hash of one limited key: field = window µs (decimal), value =
--          "<TAT whole µs> <TAT fraction> <max>" (the fraction written
--          with %.17g so it reads back as the same double; the rate's max
--          it was written under: a value without one was written under
--          the current max); field 'e' = the key's expiry (ms since the
--          epoch) as a check last set it
--
-- A TAT written under another max keeps its units: its offset d is read
-- as d / (w / max_written) * T.
-- ARGV     cost of the request (tokens it takes from every rate); then max
--          and window (µs) of each rate, in pairs
--
-- All-or-nothing: an admitted request moves every TAT; a denied one writes
-- nothing. A penalty of u units moves every offset d to max(d, 0) + u·T
-- (at most twice the longest window, 20 years), a reward to
-- max(d, 0) − u·T (at least 0). A check sets the key's expiry one longest
-- window after its latest TAT (so that the next checks need not), never
-- shortening it; a command sets it to the latest TAT exactly.
local EPSILON = 1e-9
-- Twice the longest window (src/algorithm/gcra.rs).
local MAX_OFFSET = 632448000000000

-- The limited key and its policy, set by bind(): `reads` are the rates'
-- fields and 'e', `intervals` each rate's emission interval T = w / max,
-- `longest` the longest window (µs); derived once per script call.
local key, cost, nrates, fields, reads, maxes, windows, intervals, longest

local function derive(policy)
  local names, ms, ws = policy[3], policy[4], policy[5]
  local rs, ts, l = {}, {}, 0
  for i = 1, policy[2] do
    rs[i] = names[i]
    ts[i] = ws[i] / ms[i]
    if ws[i] > l then
      l = ws[i]
    end
  end
  rs[policy[2] + 1] = 'e'
  policy[6], policy[7], policy[8] = rs, ts, l
end

local function bind(k)
  key = k
  local policy = policy_at(derive)
  cost, nrates, fields, maxes, windows = policy[1], policy[2], policy[3], policy[4], policy[5]
  reads, intervals, longest = policy[6], policy[7], policy[8]
end

-- Round a positive number of µs up; zero otherwise.
local function micros_ceil(us)
  if us > 0 then
    return math.ceil(us)
  end
  return 0
end

-- Every rate's d, the TAT's offset from now, at least 0; and the key's
-- expiry (ms) as its field 'e' records it (nil: unknown). nil and an error
-- reply for an unreadable TAT.
local function offsets()
  local stored = redis.call('HMGET', key, unpack(reads))
  local ds = {}
  for i = 1, nrates do
    local offset = 0
    if stored[i] then
      local whole, frac, written = string.match(stored[i], '^(%d+) (%S+) (%S+)$')
      if whole == nil then
        whole, frac = string.match(stored[i], '^(%d+) (%S+)$')
      end
      whole = tonumber(whole)
      frac = tonumber(frac)
      written = tonumber(written or '')
      if whole == nil or frac == nil then
        return nil, redis.error_reply('gcra: unreadable TAT in ' .. key .. ' field ' .. fields[i])
      end
      offset = (whole - now) + frac
      if written ~= nil and written ~= maxes[i] then
        offset = offset / (windows[i] / written) * intervals[i]
      end
    end
    local d = offset
    if d < 0 then
      d = 0
    end
    ds[i] = d
  end
  return ds, nil, tonumber(stored[nrates + 1] or '')
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
      writes[#writes + 1] = string.format('%.0f', now + whole) .. ' ' .. string.format('%.17g %d', kept - whole, maxes[i])
      if latest == nil or kept > latest then
        latest = kept
      end
    end
  end
  -- (DEL also drops 'e': the expiry set below is exact, not recorded.)
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

-- Write an admitted request's TATs (every offset positive) and keep the
-- key alive past the latest: the expiry is set one longest window beyond
-- what is needed, and recorded in the field 'e', so that only about one
-- admission per window and key sets it (the key outlives its last TAT by
-- at most one window). Fields of windows not in this policy are left:
-- offsets behind now read as zero.
local function admit(kepts, expiry)
  local writes = {}
  local latest = 0
  for i = 1, nrates do
    local kept = kepts[i]
    local whole = math.floor(kept)
    writes[#writes + 1] = fields[i]
    -- now + whole is an integer below 2^53 (now about 2^51, offsets at
    -- most MAX_OFFSET): '%d' is exact, and one format call is cheaper.
    writes[#writes + 1] = string.format('%d %.17g %d', now + whole, kept - whole, maxes[i])
    if kept > latest then
      latest = kept
    end
  end
  local needed = math.ceil((now + latest) / 1000)
  if expiry == nil or expiry < needed then
    local at = needed + math.ceil(longest / 1000)
    if expiry == nil then
      -- Not recorded (a command's exact expiry, or a key of an older
      -- version): never shorten what another policy's TATs on this key
      -- may need.
      local ttl = redis.call('PTTL', key)
      if ttl > 0 and math.floor(now / 1000) + ttl > at then
        at = math.floor(now / 1000) + ttl
      end
    end
    writes[#writes + 1] = 'e'
    writes[#writes + 1] = int(at)
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIREAT', key, int(at))
  else
    redis.call('HSET', key, unpack(writes))
  end
end

-- Decide one request; `commit`: count it if admitted.
local function decide(commit)
  local ds, failure, expiry = offsets()
  if ds == nil then
    return failure
  end
  local allowed = 1
  for i = 1, nrates do
    local w, interval, d = windows[i], intervals[i], ds[i]
    local new_d = d + cost * interval
    if not (new_d <= w * (1 + EPSILON)) then
      allowed = 0
    end
  end
  local out = { allowed, 0 }
  local kepts = {}
  for i = 1, nrates do
    local max, w, interval, d = maxes[i], windows[i], intervals[i], ds[i]
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
    admit(kepts, expiry)
  end
  return out
end

-- Move every rate's offset by `units` emission intervals (`sign` 1: a
-- penalty, up to MAX_OFFSET; -1: a reward, down to 0).
local function adjust(units, sign)
  local ds = offsets()
  if ds == nil then
    return
  end
  local kepts = {}
  for i = 1, nrates do
    local kept = ds[i] + sign * units * intervals[i]
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
