-- The prelude of every script, prepended at build time
-- (src/store/redis/script.rs): Redis's clock, number formatting, the
-- arguments, window indexes and the block. The script's entry point
-- (check.lua or command.lua) comes last, after the algorithm.
--
-- KEYS[1]  the state of one limited key (its algorithm's file says how)
-- KEYS[2]  its block (same hash tag, so the same cluster slot): the time in
--          µs since the epoch until which every request of the key is
--          denied; absent when the key is not blocked
-- ARGV     ARG0 arguments of the entry point (none for a check; the
--          command, its amount and an id for a command), then the
--          algorithm's arguments, read with arg(i) / num(i)
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- An integer as text: '%d' (a 64-bit conversion, faster) where the
-- double holds an exact integer, '%.0f' beyond.
local function int(x)
  if x < 9007199254740992 and x > -9007199254740992 then
    return string.format('%d', x)
  end
  return string.format('%.0f', x)
end

-- The algorithm's i-th argument, as a string and as a number.
local function arg(i)
  return ARGV[ARG0 + i]
end
local function num(i)
  return tonumber(ARGV[ARG0 + i])
end
local nargs = #ARGV - ARG0

-- Counts are kept at most 2^53, where doubles are exact (MAX_UNITS).
local MAX_COUNT = 9007199254740992

-- floor(now / w), corrected for the rounding of the division (the products
-- are exact).
local function window_index(w)
  local index = math.floor(now / w)
  if index * w > now then
    index = index - 1
  elseif (index + 1) * w <= now then
    index = index + 1
  end
  return index
end

-- The time left (µs) of the key's block, or nil when it is not blocked.
local function block_left()
  local ends = tonumber(redis.call('GET', KEYS[2]) or '')
  if ends ~= nil and ends > now then
    return ends - now
  end
  return nil
end

-- The window counters' and GCRA's policy at ARG0 (cost, then each rate's
-- max and window µs), read once per script call however many keys it
-- checks: { cost, number of rates, field names (the windows as text),
-- maxes, windows }, then what `derive(policy)` adds for the algorithm.
--
-- A calendar rate's window (the fixed window's only) is written
-- '<field>@<b1>,<b2>,...': the name of its field (never a number) and
-- consecutive boundaries (µs) the client computed around its own time;
-- its entry in windows is the list of boundaries.
local policies = {}
local function policy_at(derive)
  local policy = policies[ARG0]
  if not policy then
    local n = (nargs - 1) / 2
    local names, maxes, windows = {}, {}, {}
    for i = 1, n do
      names[i] = arg(2 * i + 1)
      maxes[i] = num(2 * i)
      windows[i] = tonumber(names[i])
      if not windows[i] then
        local name, list = string.match(names[i], '^([^@]+)@([%d,]+)$')
        if not name then
          error({ err = 'ERR not a window: ' .. tostring(names[i]) })
        end
        local bounds = {}
        for b in string.gmatch(list, '%d+') do
          bounds[#bounds + 1] = tonumber(b)
        end
        names[i], windows[i] = name, bounds
      end
    end
    policy = { num(1), n, names, maxes, windows }
    derive(policy)
    policies[ARG0] = policy
  end
  return policy
end

-- Point the algorithm at one limited key and at its policy's arguments
-- (ARG0, nargs): a check or a command binds KEYS[1]; a batch of checks
-- (batch.lua) binds each of its keys in turn, with the check's request id
-- (the sliding log's; nil for the others) as a second argument. The window
-- counters, GCRA and the sliding log define it; the concurrency limit reads
-- KEYS[1] and its arguments once and needs nothing.
local function bind()
end

-- The integer counts at `ks` (the window counters'; none is 0).
local function read_counts(ks)
  local stored = redis.call('MGET', unpack(ks))
  local counts = {}
  for i = 1, #ks do
    counts[i] = tonumber(stored[i] or '0') or 0
  end
  return counts
end

-- Add `units` (and as `text`: Lua would write a large number with an
-- exponent) to the integer count at `k` (the window counters'); a new
-- count lives until `at` (ms). Its count after.
local function add_count(k, units, text, at)
  local count = redis.call('INCRBY', k, text)
  if count == units then
    redis.call('PEXPIREAT', k, at)
  end
  return count
end

-- add_count to every count of `ks` (a new one living until its `ats`), all
-- or none: a failing one (a key of another type) fails the check, and what
-- the others counted goes back first. The counts after.
local function add_counts(ks, ats, units, text)
  local counts = {}
  for i = 1, #ks do
    local ok, count = pcall(add_count, ks[i], units, text, ats[i])
    if not ok then
      for j = 1, i - 1 do
        redis.call('DECRBY', ks[j], text)
      end
      error(count)
    end
    counts[i] = count
  end
  return counts
end

-- The keys of the limited key's state besides KEYS[1], which a reset
-- deletes too: none, but for the window counters' counts.
local function state_keys()
  return {}
end

-- Whether this check is a retry of a request that already counted (its
-- reply was lost): its reply, or nil. The default, for algorithms where
-- nothing identifies a request (a retry counts again); the sliding log and
-- the concurrency limit define their own.
local function retried()
  return nil
end

-- A batched check's reply, or nil and an error reply (batch.lua), for an
-- algorithm whose client takes the decision from what the script saw
-- (GCRA assigns it); nil elsewhere: the check's `decide(true)` in a
-- `pcall`, then `encode`.
local decide_batched = nil

-- How a refund (command.lua) removes one check's own entries, for the
-- algorithms that keep entries per request (the sliding log, the
-- concurrency limit assign it); nil elsewhere: a refund is a reward.
local refund = nil

-- Set the hash `key`'s `fields` (name, value, ...) and delete its `gone`
-- fields; make the key live until `expires_at` (µs) at least: never shorten
-- it, since fields another policy counts on this key may need longer.
-- `covered`: the caller knows the key already lives that long (every field
-- it writes was last written for the same windows, with this expiry), so
-- neither its TTL is read nor its expiry set: one command instead of three.
local function write_fields(key, fields, gone, expires_at, covered)
  if #gone > 0 then
    redis.call('HDEL', key, unpack(gone))
  end
  if #fields > 0 then
    redis.call('HSET', key, unpack(fields))
    if covered then
      return
    end
    local at = math.ceil(expires_at / 1000)
    local ttl = redis.call('PTTL', key)
    if ttl < 0 or math.floor(now / 1000) + ttl < at then
      redis.call('PEXPIREAT', key, int(at))
    end
  end
end

-- Write counts in chunks (unpack has a limit on its arguments).
local function zadd_many(key, score, base, n)
  local args = {}
  for j = 1, n do
    args[#args + 1] = score
    args[#args + 1] = base .. ':' .. j
    if #args >= 1000 or j == n then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
end

-- A check's reply of integers as one string, separated by spaces: the
-- client's reply parser costs about as much per value as per string, so a
-- decision is one value to it, not five. (The usual sizes, a decision of one
-- rate and a block, have constant formats: no string is built for them.)
local function encode(reply)
  local n = #reply
  local format
  if n == 5 then
    format = '%d %d %d %d %d'
  elseif n == 2 then
    format = '%d %d'
  else
    format = string.rep('%d ', n - 1) .. '%d'
  end
  return string.format(format, unpack(reply))
end
