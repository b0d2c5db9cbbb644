-- Registers a front-filter identity session (RedisFilter::connect_for_store).
-- KEYS[1] = {prefix}fs:{store_id}; ARGV[1] = the session number the store just took;
-- ARGV[2] = how long the register lives, in ms.
-- Returns 1 when ARGV[1] is above the highest number registered for this identity (it is
-- recorded), 0 otherwise: the store went back in time (a restore, a failover that lost
-- commits) or is a copy, and must rotate its identity.
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = tonumber(ARGV[1])
if n > seen then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
