-- Concurrency limit (a distributed semaphore), decided inside Redis on
-- Redis's own clock (TIME), with the semantics of the memory store
-- (src/store/memory/concurrency.rs).
--
-- KEYS[1]  a sorted set of one limited key's leases: member = lease id
--          (32 lowercase hex digits), score = expiry in µs since the epoch
-- ARGV[1]  max leases held at once
-- ARGV[2]  lease time, µs
-- ARGV[3]  this request's lease id
-- ARGV[4]  the longest wait suggested to a denied request, µs
--
-- Returns {allowed (1/0), remaining, wait µs}. Expired leases are dropped
-- first; an admitted request adds its lease. A lease already held (a retry
-- of a request whose reply was lost) is admitted again without counting
-- twice.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local key = KEYS[1]
local max = tonumber(ARGV[1])
local lease_time = tonumber(ARGV[2])
local member = ARGV[3]
local cap = tonumber(ARGV[4])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x)
  return string.format('%.0f', x)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
local held = redis.call('ZCARD', key)
if redis.call('ZSCORE', key, member) then
  held = held - 1
end

if held < max then
  local expiry = now + lease_time
  redis.call('ZADD', key, int(expiry), member)
  -- The key lives as long as its latest lease.
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local latest = tonumber(last[2])
  if latest == nil or latest < expiry then
    latest = expiry
  end
  redis.call('PEXPIRE', key, int(math.ceil((latest - now) / 1000)))
  return { 1, max - held - 1, 0 }
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
return { 0, remaining, wait }
