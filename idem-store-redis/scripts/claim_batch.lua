-- Batch claim on one server: SET key token NX PX lease GET for every key, in one command.
-- (On a cluster the keys live in different slots: there the claims are pipelined SETs.)
-- KEYS     the keys to claim
-- ARGV[1]  our lease token
-- ARGV[2]  the lease, in milliseconds
-- Returns, per key, false (nil) where the key was set, or the value that was already there.
local out = {}
for i, k in ipairs(KEYS) do
  out[i] = redis.call('SET', k, ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
end
return out
