"""Lua scripts of the trajectory buffer: each runs atomically inside Redis."""

# Atomic producer step (KEYS: stream, unconsumed set, put key, counts hash; ARGV: type, group id,
# payload, max_pending_groups, maxlen, put-key ttl s). Returns {1, entry id} or {0, reason}.
# The length cap only ever trims entries older than the oldest unconsumed one (XTRIM
# MINID), i.e. acknowledged entries; when that is not enough the put waits like backpressure.
PUT_LUA = """
local existing = redis.call('GET', KEYS[3])
if existing then return {1, existing} end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  if am ~= bm then return am < bm end
  return as < bs
end
local max_pending = tonumber(ARGV[4])
local maxlen = tonumber(ARGV[5])
local unconsumed = redis.call('SCARD', KEYS[2])
if unconsumed >= max_pending then
  return {0, 'unconsumed groups ' .. unconsumed .. ' >= max_pending_groups ' .. max_pending}
end
if redis.call('XLEN', KEYS[1]) >= maxlen then
  local oldest = nil
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if oldest == nil or older(id, oldest) then oldest = id end
  end
  if oldest then
    redis.call('XTRIM', KEYS[1], 'MINID', oldest)
  else
    redis.call('XTRIM', KEYS[1], 'MAXLEN', maxlen - 1)
  end
  local len = redis.call('XLEN', KEYS[1])
  if len >= maxlen then
    return {0, 'stream length ' .. len .. ' >= maxlen ' .. maxlen ..
      ' and the oldest entry not yet acknowledged is ' .. tostring(oldest)}
  end
end
local id = redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'group_id', ARGV[2], 'data', ARGV[3])
redis.call('SADD', KEYS[2], id)
redis.call('SET', KEYS[3], id, 'EX', tonumber(ARGV[6]))
redis.call('HINCRBY', KEYS[4], 'added', 1)
return {1, id}
"""

# Keeps entries with their consumer (KEYS: stream; ARGV: group, consumer, ids...): resets
# the idle time of each id still pending for `consumer` (XCLAIM JUSTID: the delivery count
# is unchanged). Returns 1 per id still owned, 0 per id acknowledged or reclaimed by another.
TOUCH_LUA = """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# Acknowledgement (KEYS: stream, unconsumed set, trained sorted set; ARGV: group, keep_acked,
# trained ttl s, trained_max, now s, n, n entry ids, then the group ids to record as trained).
# XACK + SREM of each id, ZADD of the trained ids (score: now), then the trained set is cut to
# ids newer than now - ttl and to the newest trained_max, and acknowledged history beyond
# keep_acked entries is deleted oldest first (an id still in the unconsumed set is never
# deleted). Returns how many ids were still pending.
ACK_LUA = """
local n = tonumber(ARGV[6])
local acked = 0
for i = 7, 6 + n do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('SREM', KEYS[2], ARGV[i])
end
local now = tonumber(ARGV[5])
if #ARGV >= 7 + n then
  for i = 7 + n, #ARGV do
    redis.call('ZADD', KEYS[3], now, ARGV[i])
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. tostring(now - tonumber(ARGV[3])))
  local card = redis.call('ZCARD', KEYS[3])
  local maxn = tonumber(ARGV[4])
  if card > maxn then redis.call('ZREMRANGEBYRANK', KEYS[3], 0, card - maxn - 1) end
end
local excess = redis.call('XLEN', KEYS[1]) - redis.call('SCARD', KEYS[2]) - tonumber(ARGV[2])
local start = '-'
while excess > 0 do
  local batch = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 100)
  if #batch == 0 then break end
  for _, e in ipairs(batch) do
    if excess <= 0 then break end
    if redis.call('SISMEMBER', KEYS[2], e[1]) == 0 then
      redis.call('XDEL', KEYS[1], e[1])
      excess = excess - 1
    end
    start = '(' .. e[1]
  end
end
return acked
"""
