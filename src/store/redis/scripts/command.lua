
-- The entry point of an operator's command (Store::command), atomic:
-- ARGV[1]  peek, reset, block, penalty, reward or refund
-- ARGV[2]  block: its length in µs (0 lifts it); penalty, reward, refund: units
-- ARGV[3]  an id unique across processes (the members a penalty writes);
--          refund: the id of the check given back (its members)
-- Replies as a check (counting nothing): the decision a request of the
-- policy's cost would get after the command.
bind(KEYS[1])
local command = ARGV[1]
local amount = tonumber(ARGV[2])
if command == 'reset' then
  redis.call('DEL', KEYS[1], KEYS[2], unpack(state_keys()))
elseif command == 'block' then
  if amount > 0 then
    local ends = now + amount
    redis.call('SET', KEYS[2], int(ends))
    redis.call('PEXPIREAT', KEYS[2], int(math.ceil(ends / 1000)))
  else
    redis.call('DEL', KEYS[2])
  end
elseif command == 'penalty' then
  penalty(amount, ARGV[3])
elseif command == 'reward' then
  reward(amount)
elseif command == 'refund' then
  -- Algorithms keeping entries per request remove the check's own;
  -- the others give the units back as a reward.
  if refund then
    refund(amount, ARGV[3])
  else
    reward(amount)
  end
elseif command ~= 'peek' then
  return redis.error_reply('unknown command ' .. tostring(command))
end
local left = block_left()
if left then
  return { -1, int(left) }
end
return decide(false)
