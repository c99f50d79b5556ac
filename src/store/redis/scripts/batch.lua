
-- The entry point of a batch of checks of one algorithm (the window
-- counters, GCRA and the sliding log, on a single Redis, not a cluster: the
-- keys need not share a slot), decided on one reading of Redis's clock:
-- KEYS     the state of each checked key, then the block of each, in the
--          same order (n of each)
-- ARGV[1]  P, the number of distinct policies; then each policy as its
--          number of arguments and the algorithm's arguments (as a single
--          check's, the sliding log's request id empty); then, when P > 1,
--          each check's policy (1 to P); then, for the sliding log, 1 if
--          the batch is sent again after its reply was lost (each check
--          looks for its own entries first, as check.lua's `retried`), else
--          0, and each check's request id
-- Replies with each check's reply, in order, as check.lua would: its
-- decision, or {-1, time left µs} for a blocked key, each as one string of
-- its integers (`encode`), but for GCRA's decisions (`decide_batched`:
-- bytes, from which the client takes the decision); an error of one check
-- (an unreadable state, a key of another type) is the array {-2, message},
-- so that it fails only that check.
local n = #KEYS / 2
local blocks = redis.call('MGET', unpack(KEYS, n + 1, 2 * n))
local starts, lengths = {}, {}
local a = 2
for p = 1, tonumber(ARGV[1]) do
  starts[p] = a
  lengths[p] = tonumber(ARGV[a])
  a = a + lengths[p] + 1
end
local several = #starts > 1
-- The sliding log's: whether the batch is sent again, and where its
-- request ids start (nil past the end for the other algorithms).
local resent_at = a
if several then
  resent_at = resent_at + n
end
local resent = ARGV[resent_at] == '1'
local first_id = resent_at + 1
-- The reply of a check that failed with `error` (a key of another type
-- under the prefix): this check's alone.
local function failed(error)
  if type(error) == 'table' and error.err then
    error = error.err
  end
  return { -2, tostring(error) }
end
-- A retry's reply, or nil.
local function retry_reply()
  local ok, result = pcall(retried)
  if not ok then
    return failed(result)
  end
  return result and encode(result)
end
local out = {}
for d = 1, n do
  local p = 1
  if several then
    p = tonumber(ARGV[a - 1 + d])
  end
  ARG0, nargs = starts[p], lengths[p]
  bind(KEYS[d], ARGV[first_id - 1 + d])
  local ends = blocks[d] and tonumber(blocks[d])
  local reply = resent and retry_reply()
  if reply then
    -- A request that already counted: admitted again, counting nothing.
  elseif ends and ends > now then
    reply = encode({ -1, ends - now })
  elseif decide_batched then
    -- GCRA reads before it writes, with `redis.pcall`: a key of another
    -- type under the prefix fails this check alone, as its error reply.
    local result, failure = decide_batched()
    if failure then
      reply = { -2, failure.err }
    else
      reply = result
    end
  else
    -- A failing command (a key of another type under the prefix) fails
    -- this check alone: the window counters give back what they counted
    -- before the failure; the sliding log writes its entries last.
    local ok, result = pcall(decide, true)
    if not ok or result.err then
      reply = failed(result)
    else
      reply = encode(result)
    end
  end
  out[d] = reply
end
return out
