-- Sliding log, decided inside Redis on Redis's own clock (TIME).
--
-- KEYS[1]  the sorted set of one limited key (members: the request id, or
--          "<request id>:<unit>" when the cost is over 1; scores: µs since
--          the epoch)
-- ARGV[1]  cost: entries an admitted request adds
-- ARGV[2]  minimum spacing between admitted requests, µs (0: none)
-- ARGV[3]  a request id unique across every process
-- ARGV[4], ARGV[5], ...  max and window (µs) of each rate, in pairs
--
-- Returns {allowed (1/0), spacing wait µs, then per rate: remaining, reset µs, wait µs}.
-- A denied request writes nothing. A request whose entries are already in
-- the set (a retry after its reply was lost) is admitted again and writes
-- nothing more: it counts once.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local key = KEYS[1]
local cost = tonumber(ARGV[1])
local spacing = tonumber(ARGV[2])
local id = ARGV[3]
local nrates = (#ARGV - 3) / 2

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x)
  return string.format('%.0f', x)
end

local longest = spacing
for i = 1, nrates do
  local w = tonumber(ARGV[3 + 2 * i])
  if w > longest then
    longest = w
  end
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - longest))

local function member(j)
  if cost == 1 then
    return id
  end
  return id .. ':' .. j
end

local counted = redis.call('ZSCORE', key, member(1))
if counted then
  local out = { 1, 0 }
  for i = 1, nrates do
    local max = tonumber(ARGV[2 + 2 * i])
    local w = tonumber(ARGV[3 + 2 * i])
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
  local max = tonumber(ARGV[2 + 2 * i])
  local w = tonumber(ARGV[3 + 2 * i])
  local c = redis.call('ZCOUNT', key, '(' .. int(now - w), '+inf')
  counts[i] = c
  if c + cost > max then
    allowed = 0
  end
end

local out = { allowed, int(spacing_wait) }
for i = 1, nrates do
  local max = tonumber(ARGV[2 + 2 * i])
  local w = tonumber(ARGV[3 + 2 * i])
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

if allowed == 1 then
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
