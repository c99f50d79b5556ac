-- Sliding log, decided inside Redis on Redis's own clock (TIME), with the
-- semantics of src/algorithm/sliding_log.rs.
--
-- KEYS[1]  the sorted set of one limited key (members: the request id, or
--          "<request id>:<unit>" when the cost is over 1; scores: µs since
--          the epoch)
-- ARGV     cost: entries an admitted request adds; the minimum spacing
--          between admitted requests, µs (0: none); a request id unique
--          across every process; then max and window (µs) of each rate, in
--          pairs
--
-- A denied request writes nothing. A request whose entries are already in
-- the set (a retry after its reply was lost) is admitted again and writes
-- nothing more: it counts once. A penalty adds entries at now (at most the
-- largest max, and at most 10,000: MAX_COST); a reward removes the newest entries.
local call, unpack = redis.call, unpack
local MAX_PENALTY_ENTRIES = 10000

-- The limited key, its policy and the request's id, set by bind():
-- `maxes` and `windows` each rate's, `froms` the `ZCOUNT` bound (as text)
-- past which entries are in each rate's window, `longest` the longest
-- window or the spacing, `largest` the largest max, `oldest` the score (as
-- text) at and below which entries are dropped, `ttl` the key's life (ms)
-- after an admission; derived once per policy of a script call (on its one
-- reading of the clock).
local key, cost, spacing, id, nrates, maxes, windows, froms, longest, largest, oldest, ttl
local derived = {}
-- Whether the key's old entries were dropped in this call (once per key:
-- the retry check and the decision both need it).
local trimmed

-- Point the script at key `k` and at the policy at ARG0; `request`: the
-- check's id in a batch (each check's own), else the policy's argument.
-- (The window counters' and GCRA's `policy_at` reads another layout of
-- arguments: windows that may be calendars, and no id.)
local function bind(k, request)
  key, trimmed = k, false
  id = request or arg(3)
  local policy = derived[ARG0]
  if not policy then
    local n, l, m = (nargs - 3) / 2, num(2), 0
    local ms, ws, fs = {}, {}, {}
    for i = 1, n do
      ms[i], ws[i] = num(2 + 2 * i), num(3 + 2 * i)
      fs[i] = '(' .. int(now - ws[i])
      if ws[i] > l then
        l = ws[i]
      end
      if ms[i] > m then
        m = ms[i]
      end
    end
    policy = { num(1), num(2), n, ms, ws, fs, l, m, int(now - l), math.ceil(l / 1000) }
    derived[ARG0] = policy
  end
  cost, spacing, nrates, maxes, windows = policy[1], policy[2], policy[3], policy[4], policy[5]
  froms, longest, largest, oldest, ttl = policy[6], policy[7], policy[8], policy[9], policy[10]
end

-- The member of the request's j-th entry.
local function member(j)
  if cost == 1 then
    return id
  end
  return id .. ':' .. j
end

-- Drop the entries older than the longest window, once per key and call.
local function trim()
  if not trimmed then
    trimmed = true
    call('ZREMRANGEBYSCORE', key, '-inf', oldest)
  end
end

-- The entries in rate i's window: once trimmed, all of them for the
-- longest window (`ZCARD`, which reads no score).
local function count_in(i)
  if trimmed and windows[i] >= longest then
    return call('ZCARD', key)
  end
  return call('ZCOUNT', key, froms[i], '+inf')
end

-- The score of the entry of reverse rank r (0: the newest), or nil.
local function entry_at(r)
  local e = call('ZREVRANGE', key, r, r, 'WITHSCORES')
  if #e > 0 then
    return tonumber(e[2])
  end
  return nil
end

-- A denial's remaining, reset and wait for rate i, whose window holds c
-- entries, the newest at `newest`: the window empties a window after its
-- newest entry; a request of `cost` is admitted once at most max - cost
-- entries are left in it: when the entry of reverse rank max - cost leaves
-- it (the newest itself for a cost of max).
local function denied_rate(i, c, newest)
  local max, w = maxes[i], windows[i]
  local reset = 0
  if c > 0 and newest ~= nil then
    reset = newest + w - now
  end
  local wait = 0
  if c + cost > max then
    local blocker = newest
    if max ~= cost then
      blocker = entry_at(max - cost)
    end
    wait = w
    if blocker ~= nil then
      wait = blocker + w - now
    end
  end
  return math.max(max - c, 0), reset, wait
end

-- The same request again (its reply was lost): admitted, counting nothing
-- more: its first entry is still in the longest window. (Looked for
-- before anything is written: a request not found goes on to be decided,
-- and a denial writes nothing.)
local function retried()
  local score = tonumber(call('ZSCORE', key, member(1)) or '')
  if not score or score <= now - longest then
    return nil
  end
  trim()
  local out = { 1, 0 }
  for i = 1, nrates do
    local remaining = maxes[i] - count_in(i)
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = remaining
    out[#out + 1] = windows[i]
    out[#out + 1] = 0
  end
  return out
end

-- The entries' score: the script's one reading of the clock.
local stamp = int(now)

-- Write an admitted request's entries (dropping the old ones first); the
-- key lives a longest window after them.
local function admit()
  trim()
  if cost == 1 then
    call('ZADD', key, stamp, id)
  else
    zadd_many(key, stamp, id, cost)
  end
  call('PEXPIRE', key, ttl)
end

-- Decide one request; `commit`: write its entries if admitted. A denial
-- writes nothing (the old entries are dropped by the next admission); the
-- newest entry is read only where it matters: for the spacing, and for a
-- denial's reset.
local function decide(commit)
  if nrates == 1 and spacing == 0 then
    -- One rate: an admission needs its count alone, a denial its times.
    local c = count_in(1)
    if c + cost <= maxes[1] then
      if commit then
        admit()
      end
      return { 1, 0, maxes[1] - c - cost, windows[1], 0 }
    end
    local remaining, reset, wait = denied_rate(1, c, entry_at(0))
    return { 0, 0, remaining, reset, wait }
  end
  local newest = nil
  local allowed = 1
  local spacing_wait = 0
  if spacing > 0 then
    newest = entry_at(0)
    if newest ~= nil and newest + spacing > now then
      allowed = 0
      spacing_wait = newest + spacing - now
    end
  end

  local counts = {}
  for i = 1, nrates do
    local c = count_in(i)
    counts[i] = c
    if c + cost > maxes[i] then
      allowed = 0
    end
  end
  if allowed == 0 and spacing == 0 then
    newest = entry_at(0)
  end

  local out = { allowed, spacing_wait }
  for i = 1, nrates do
    local c = counts[i]
    if allowed == 1 then
      out[#out + 1] = maxes[i] - c - cost
      out[#out + 1] = windows[i]
      out[#out + 1] = 0
    else
      local remaining, reset, wait = denied_rate(i, c, newest)
      out[#out + 1] = remaining
      out[#out + 1] = reset
      out[#out + 1] = wait
    end
  end

  if allowed == 1 and commit then
    admit()
  end
  return out
end

local function penalty(units, pid)
  trim()
  local n = math.min(units, largest, MAX_PENALTY_ENTRIES)
  if n > 0 then
    zadd_many(key, stamp, pid, n)
    call('PEXPIRE', key, ttl)
  end
end

local function reward(units)
  trim()
  if units > 0 then
    call('ZREMRANGEBYRANK', key, int(-units), -1)
  end
end

-- Remove the entries of one check (request id `rid`): `rid` for a cost of
-- 1, `rid:1` ... `rid:units` otherwise (the check's cost may differ from
-- this command's policy's).
-- In chunks, as zadd_many writes them (unpack has a limit on its
-- arguments).
refund = function(units, rid)
  local members = { rid }
  local n = math.min(units, MAX_PENALTY_ENTRIES)
  for j = 1, n do
    members[#members + 1] = rid .. ':' .. j
    if #members >= 1000 or j == n then
      call('ZREM', key, unpack(members))
      members = {}
    end
  end
  if #members > 0 then
    call('ZREM', key, unpack(members))
  end
end
