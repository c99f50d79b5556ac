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
local key = KEYS[1]
local cost = num(1)
local spacing = num(2)
local id = arg(3)
local nrates = (nargs - 3) / 2
local MAX_PENALTY_ENTRIES = 10000

local longest = spacing
local largest = 0
for i = 1, nrates do
  local w = num(3 + 2 * i)
  if w > longest then
    longest = w
  end
  if num(2 + 2 * i) > largest then
    largest = num(2 + 2 * i)
  end
end

local function member(j)
  if cost == 1 then
    return id
  end
  return id .. ':' .. j
end

-- Drop the entries older than the longest window, once per call (the retry
-- check and the decision both need it).
local trimmed = false
local function trim()
  if not trimmed then
    trimmed = true
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - longest))
  end
end

-- The same request again (its reply was lost): admitted, counting nothing
-- more.
local function retried()
  trim()
  if not redis.call('ZSCORE', key, member(1)) then
    return nil
  end
  local out = { 1, 0 }
  for i = 1, nrates do
    local max = num(2 + 2 * i)
    local w = num(3 + 2 * i)
    local remaining = max - redis.call('ZCOUNT', key, '(' .. int(now - w), '+inf')
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = remaining
    out[#out + 1] = int(w)
    out[#out + 1] = 0
  end
  return out
end

-- Decide one request; `commit`: write its entries if admitted.
local function decide(commit)
  trim()
  local newest = nil
  local last = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
  if #last > 0 then
    newest = tonumber(last[2])
  end

  local allowed = 1
  local spacing_wait = 0
  if spacing > 0 and newest ~= nil and newest + spacing > now then
    allowed = 0
    spacing_wait = newest + spacing - now
  end

  local counts = {}
  for i = 1, nrates do
    local max = num(2 + 2 * i)
    local w = num(3 + 2 * i)
    local c = redis.call('ZCOUNT', key, '(' .. int(now - w), '+inf')
    counts[i] = c
    if c + cost > max then
      allowed = 0
    end
  end

  local out = { allowed, int(spacing_wait) }
  for i = 1, nrates do
    local max = num(2 + 2 * i)
    local w = num(3 + 2 * i)
    local c = counts[i]
    if allowed == 1 then
      out[#out + 1] = max - c - cost
      out[#out + 1] = int(w)
      out[#out + 1] = 0
    else
      local reset = 0
      if c > 0 and newest ~= nil then
        reset = newest + w - now
      end
      local wait = 0
      if c + cost > max then
        -- Admitted once at most max - cost entries are left in the window:
        -- when the entry of reverse rank max - cost leaves it.
        local e = redis.call('ZREVRANGE', key, max - cost, max - cost, 'WITHSCORES')
        if #e > 0 then
          wait = tonumber(e[2]) + w - now
        else
          wait = w
        end
      end
      local remaining = max - c
      if remaining < 0 then
        remaining = 0
      end
      out[#out + 1] = remaining
      out[#out + 1] = int(reset)
      out[#out + 1] = int(wait)
    end
  end

  if allowed == 1 and commit then
    local stamp = int(now)
    local args = {}
    for j = 1, cost do
      args[#args + 1] = stamp
      args[#args + 1] = member(j)
      if #args >= 1000 or j == cost then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    redis.call('PEXPIRE', key, math.ceil(longest / 1000))
  end
  return out
end

local function penalty(units, pid)
  trim()
  local n = math.min(units, largest, MAX_PENALTY_ENTRIES)
  if n > 0 then
    zadd_many(key, int(now), pid, n)
    redis.call('PEXPIRE', key, math.ceil(longest / 1000))
  end
end

local function reward(units)
  trim()
  if units > 0 then
    redis.call('ZREMRANGEBYRANK', key, int(-units), -1)
  end
end

-- Remove the entries of one check (request id `rid`): `rid` for a cost of
-- 1, `rid:1` ... `rid:units` otherwise (the check's cost may differ from
-- this command's policy's).
refund = function(units, rid)
  local members = { rid }
  for j = 1, math.min(units, MAX_PENALTY_ENTRIES) do
    members[#members + 1] = rid .. ':' .. j
  end
  redis.call('ZREM', key, unpack(members))
end
