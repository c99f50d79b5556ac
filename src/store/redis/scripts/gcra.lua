-- GCRA (token bucket), decided inside Redis on Redis's own clock (TIME).
-- The same IEEE double operations in the same order as
-- src/algorithm/gcra.rs, so both give the same answers. The arithmetic
-- works on the TAT's offset from now, where magnitudes are small: at today's
-- timestamps (~1.7e15 µs) a double only resolves 0.25 µs.
--
-- KEYS[1]  a hash of one limited key: field = window µs (decimal), value =
--          the rate's TAT: 'b' and four little-endian doubles (struct
--          '<Bdddd', the marker 98 first): its whole µs, its fraction, the rate's max it was
--          written under and the key's expiry (ms since the epoch) as the
--          check that wrote it set or found it (0: not known), read and
--          written without formatting a number, one field a rate (a
--          policy of one rate reads one `HGET`); the text
--          "<TAT whole µs> <TAT fraction> <max>" of earlier versions is
--          read too (without its max: written under the current max; its
--          expiry not known)
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
--
-- A batch decides many checks in one call: what a check does is kept to
-- its two commands, and the tables it fills are the call's, reused by
-- every check (a table per check cost a batch more than its commands).
local EPSILON = 1e-9
-- Twice the longest window (src/algorithm/gcra.rs).
local MAX_OFFSET = 632448000000000
-- The latest whole µs a TAT holds: MAX_OFFSET past 2^53 µs (and past
-- any expiry in ms).
local MAX_TIME = 9007199254740992 + MAX_OFFSET
-- The largest max of a rate (MAX_MAX in src/policy/mod.rs).
local MAX_MAX = 9007199254740992

local floor, ceil, byte, match = math.floor, math.ceil, string.byte, string.match
local pack, unpack_struct = struct.pack, struct.unpack
-- (Locals: a global is looked up by name at every use.)
local call, pcall_redis, unpack, type = redis.call, redis.pcall, unpack, type

-- The limited key and its policy, set by bind(): `intervals` each rate's
-- emission interval T = w / max,
-- `limits` the most each offset may reach (w with the tolerance),
-- `longest` the longest window (µs), `reply_format` a batched check's
-- reply's; derived once per script call.
local key, cost, nrates, fields, maxes, windows, intervals, limits, longest, reply_format
local bound

local function derive(policy)
  local names, ms, ws = policy[3], policy[4], policy[5]
  local ts, ls, l = {}, {}, 0
  for i = 1, policy[2] do
    ts[i] = ws[i] / ms[i]
    ls[i] = ws[i] * (1 + EPSILON)
    if ws[i] > l then
      l = ws[i]
    end
  end
  policy[6], policy[7], policy[8] = ts, l, ls
  policy[9] = '<B' .. string.rep('d', policy[2])
end

local function bind(k)
  key = k
  if bound == ARG0 then
    return
  end
  bound = ARG0
  local policy = policy_at(derive)
  cost, nrates, fields, maxes, windows = policy[1], policy[2], policy[3], policy[4], policy[5]
  intervals, longest, limits, reply_format = policy[6], policy[7], policy[8], policy[9]
end

-- Each rate's offset before the check (at least 0) and after it is
-- decided, the values read and the hash's writes: filled anew by each
-- check.
local ds, kepts, stored, writes = {}, {}, {}, {}

-- Round a positive number of µs up; zero otherwise.
local function micros_ceil(us)
  if us > 0 then
    return ceil(us)
  end
  return 0
end

-- Rate i's TAT as stored, `offset` µs from now, the key living until
-- `expiry` (ms; 0: not known).
local function tat(i, offset, expiry)
  local whole = floor(offset)
  return pack('<Bdddd', 98, now + whole, offset - whole, maxes[i], expiry)
end

-- Rate i's offset from now as the stored `value` says (not yet floored at
-- 0), and the key's expiry it records (ms; 0: not known); nil for a
-- value that does not read, or holds a time, fraction, max or expiry no
-- check writes (a NaN fails every comparison).
local function offset_of(value, i)
  local whole, frac, written
  local expiry = 0
  if byte(value, 1) == 98 and #value == 33 then
    local _
    _, whole, frac, written, expiry = unpack_struct('<Bdddd', value)
  else
    whole, frac, written = match(value, '^(%d+) (%S+) (%S+)$')
    if whole == nil then
      whole, frac = match(value, '^(%d+) (%S+)$')
    end
    whole = tonumber(whole)
    frac = tonumber(frac)
    written = tonumber(written or '') or maxes[i]
    if whole == nil or frac == nil then
      return nil
    end
  end
  if not (whole >= 0 and whole <= MAX_TIME and frac >= 0 and frac < 1
      and written >= 1 and written <= MAX_MAX and floor(written) == written
      and expiry >= 0 and expiry <= MAX_TIME) then
    return nil
  end
  local offset = (whole - now) + frac
  if written ~= maxes[i] then
    offset = offset / (windows[i] / written) * intervals[i]
  end
  return offset, expiry
end

-- Rate i's d, the TAT's offset from now at least 0, as the stored `value`
-- says (false: none yet, 0), and the key's expiry it records (ms; 0: not
-- known); nil for a value that does not read.
local function d_of(value, i)
  if not value then
    return 0, 0
  end
  local d, expiry = offset_of(value, i)
  if d == nil then
    return nil
  end
  if d < 0 then
    d = 0
  end
  return d, expiry
end

-- The error of rate i's value that does not read.
local function unreadable(i)
  return redis.error_reply('gcra: unreadable TAT in ' .. key .. ' field ' .. fields[i])
end

-- Fill `ds` with every rate's d, the TAT's offset from now, at least 0.
-- The key's expiry (ms) as every rate's value records it (0: not known);
-- or false and an error reply (a key of another type, an unreadable TAT),
-- read before anything is written.
local function offsets()
  if nrates == 1 then
    local value = pcall_redis('HGET', key, fields[1])
    if type(value) == 'table' then
      return false, value
    end
    stored[1] = value
  else
    local values = pcall_redis('HMGET', key, unpack(fields))
    if values.err then
      return false, values
    end
    for i = 1, nrates do
      stored[i] = values[i]
    end
  end
  local known = nil
  for i = 1, nrates do
    local d, expiry = d_of(stored[i], i)
    if d == nil then
      return false, unreadable(i)
    end
    ds[i] = d
    if known == nil or expiry < known then
      known = expiry
    end
  end
  return known
end

-- The hash becomes exactly the offsets `kepts` still ahead of now.
local function store()
  local m = 0
  local latest = nil
  for i = 1, nrates do
    local kept = kepts[i]
    if kept > 0 then
      writes[m + 1] = fields[i]
      writes[m + 2] = tat(i, kept, 0)
      m = m + 2
      if latest == nil or kept > latest then
        latest = kept
      end
    end
  end
  -- (The expiry set below is exact, not recorded: the values say 0.)
  call('DEL', key)
  if latest ~= nil then
    call('HSET', key, unpack(writes, 1, m))
    -- On the script's one reading of the clock, as every expiry it sets.
    call('PEXPIREAT', key, int(ceil((now + latest) / 1000)))
  end
end

-- The key's expiry (ms) once an admitted request's latest TAT is `latest`
-- µs from now, the values read recording `expiry` (0: not known), and
-- whether it must be set: it is set one longest window beyond what is
-- needed, and recorded in every value written, so that only about one
-- admission per window and key sets it (the key outlives its last TAT by
-- at most one window). Setting it, the key's TTL is read first: an expiry
-- another policy's TATs on this key need (its values record their own) is
-- never shortened.
local function expiry_for(latest, expiry)
  local needed = ceil((now + latest) / 1000)
  if expiry >= needed then
    return expiry, false
  end
  local at = needed + ceil(longest / 1000)
  local ttl = call('PTTL', key)
  local lives = floor(now / 1000) + ttl
  if ttl > 0 and lives >= at then
    return lives, false
  end
  return at, true
end

-- Write an admitted request's TATs (`kepts`, every one positive) and keep
-- the key alive past the latest (expiry_for). Fields of windows not in
-- this policy are left: offsets behind now read as zero.
local function admit(expiry)
  local latest = 0
  for i = 1, nrates do
    if kepts[i] > latest then
      latest = kepts[i]
    end
  end
  local extend
  expiry, extend = expiry_for(latest, expiry)
  local m = 0
  for i = 1, nrates do
    writes[m + 1] = fields[i]
    writes[m + 2] = tat(i, kepts[i], expiry)
    m = m + 2
  end
  call('HSET', key, unpack(writes, 1, m))
  if extend then
    call('PEXPIREAT', key, int(expiry))
  end
end

-- Rate i's offset once a request is taken from offset `d`, and whether it
-- fits its window: the admission rule.
local function taken(i, d)
  local new_d = d + cost * intervals[i]
  return new_d, new_d <= limits[i]
end

-- Decide one request into `kepts` (each rate's offset after it); `commit`:
-- count it if admitted. 1 (admitted) or 0, or false and an error reply.
local function verdict(commit)
  local expiry, failure = offsets()
  if expiry == false then
    return false, failure
  end
  local allowed = 1
  for i = 1, nrates do
    local new_d, fits = taken(i, ds[i])
    kepts[i] = new_d
    if not fits then
      allowed = 0
    end
  end
  if allowed == 1 then
    if commit then
      admit(expiry)
    end
  else
    for i = 1, nrates do
      kepts[i] = ds[i]
    end
  end
  return allowed
end

-- Rate i's status after the verdict: tokens left now (how many more
-- intervals fit in the window), its reset (µs) and, denied on it, the wait
-- until the offset has shrunk to the window.
local function status(i, allowed)
  local max, w, interval, kept = maxes[i], windows[i], intervals[i], kepts[i]
  local remaining = floor((w - kept) / interval + EPSILON)
  if remaining < 0 then
    remaining = 0
  end
  if remaining > max then
    remaining = max
  end
  local wait = 0
  if allowed == 0 then
    local new_d, fits = taken(i, ds[i])
    if not fits then
      wait = micros_ceil(new_d - w)
    end
  end
  return remaining, micros_ceil(kept), wait
end

-- Decide one request; `commit`: count it if admitted. The decision as a
-- table (check.lua's reply), or an error reply.
local function decide(commit)
  local allowed, failure = verdict(commit)
  if allowed == false then
    return failure
  end
  local out = { allowed, 0 }
  for i = 1, nrates do
    local remaining, reset, wait = status(i, allowed)
    out[3 * i] = remaining
    out[3 * i + 1] = reset
    out[3 * i + 2] = wait
  end
  return out
end

-- A batched check: whether it was admitted and every rate's offset
-- before it (`ds`), as bytes (struct '<B' and a little-endian double per
-- rate): the client takes the decision from these by the same arithmetic
-- as the memory store (src/algorithm/gcra.rs), without a number
-- formatted here; or nil and an error reply. A policy of one rate, the
-- usual, is decided without the tables (about a twentieth of the script's
-- work a check).
decide_batched = function()
  if nrates ~= 1 then
    local allowed, failure = verdict(true)
    if allowed == false then
      return nil, failure
    end
    return pack(reply_format, allowed, unpack(ds, 1, nrates))
  end
  local value = pcall_redis('HGET', key, fields[1])
  if type(value) == 'table' then
    return nil, value
  end
  local d, expiry = d_of(value, 1)
  if d == nil then
    return nil, unreadable(1)
  end
  local new_d, fits = taken(1, d)
  if not fits then
    return pack('<Bd', 0, d)
  end
  local extend
  expiry, extend = expiry_for(new_d, expiry)
  call('HSET', key, fields[1], tat(1, new_d, expiry))
  if extend then
    call('PEXPIREAT', key, int(expiry))
  end
  return pack('<Bd', 1, d)
end

-- Move every rate's offset by `units` emission intervals (`sign` 1: a
-- penalty, up to MAX_OFFSET; -1: a reward, down to 0).
local function adjust(units, sign)
  if offsets() == false then
    return
  end
  for i = 1, nrates do
    local kept = ds[i] + sign * units * intervals[i]
    if kept > MAX_OFFSET then
      kept = MAX_OFFSET
    elseif kept < 0 then
      kept = 0
    end
    kepts[i] = kept
  end
  store()
end

local function penalty(units)
  adjust(units, 1)
end

local function reward(units)
  adjust(units, -1)
end
