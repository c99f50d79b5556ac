-- Concurrency limit (a distributed semaphore), decided inside Redis on
-- Redis's own clock (TIME), with the semantics of
-- src/algorithm/concurrency.rs.
--
-- KEYS[1]  a sorted set of one limited key's leases: member = lease id
--          (32 lowercase hex digits; "<id>:<j>" for a penalty's anonymous
--          slots), score = expiry in µs since the epoch
-- ARGV     max leases held at once; the lease time, µs; this request's
--          lease id; the longest wait suggested to a denied request, µs
--
-- Expired leases are dropped first; an admitted request adds its lease. A
-- lease already held (a retry of a request whose reply was lost) is
-- admitted again without counting twice. A penalty takes anonymous slots
-- (at most max) that expire after the lease time; a reward frees the
-- oldest leases (expiring soonest).
local key = KEYS[1]
local max = num(1)
local lease_time = num(2)
local member = arg(3)
local cap = num(4)

-- Drop the expired leases, once per call (the retry check and the decision
-- both need it).
local expired = false
local function expire()
  if not expired then
    expired = true
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  end
end

-- The key lives as long as its latest lease.
local function keep()
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last > 0 then
    redis.call('PEXPIRE', key, int(math.ceil((tonumber(last[2]) - now) / 1000)))
  end
end

local function take()
  redis.call('ZADD', key, int(now + lease_time), member)
  keep()
end

-- The same request again (its reply was lost), while its slot is held.
local function retried()
  expire()
  if not redis.call('ZSCORE', key, member) then
    return nil
  end
  local held = redis.call('ZCARD', key) - 1
  if held < max then
    take()
    return { 1, 0, max - held - 1, 0, 0 }
  end
  return nil
end

-- Decide one request; `commit`: take its lease if admitted.
local function decide(commit)
  expire()
  local held = redis.call('ZCARD', key)
  if held < max then
    if commit then
      take()
    end
    return { 1, 0, max - held - 1, 0, 0 }
  end
  local remaining = max - held
  if remaining < 0 then
    remaining = 0
  end
  -- A slot frees when a request finishes, which Redis cannot know: suggest
  -- retrying at the soonest lease expiry, at most the cap.
  local wait = 0
  local soonest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #soonest > 0 then
    wait = tonumber(soonest[2]) - now
    if wait > cap then
      wait = cap
    end
  end
  return { 0, 0, remaining, 0, int(wait) }
end

local function penalty(units, id)
  expire()
  -- At most 10,000 (MAX_COST): one member per slot.
  local n = math.min(units, max, 10000)
  if n > 0 then
    zadd_many(key, int(now + lease_time), id, n)
    keep()
  end
end

-- Free the slot of one check (its lease id `rid`).
refund = function(_, rid)
  redis.call('ZREM', key, rid)
end

local function reward(units)
  expire()
  if units > 0 then
    redis.call('ZREMRANGEBYRANK', key, 0, int(units - 1))
  end
end
