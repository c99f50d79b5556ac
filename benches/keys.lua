-- wrk script of scripts/bench: every request carries `x-key: k<1..10000>`,
-- the key the example server limits by (KEY=header:x-key).
math.randomseed(os.time())
request = function()
  return wrk.format(nil, nil, { ["x-key"] = "k" .. math.random(10000) })
end
