-- bench/run.py's cross-check on etcd's JSON gateway: a put-if-absent transaction, then a
-- compare-and-delete on the put's revision; a thread per connection, each on its own key.
-- Arguments: the keys, base64, one per thread.
local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

local function txn(compare, success)
  return wrk.format("POST", "/v3/kv/txn", {["Content-Type"] = "application/json"},
    '{"compare":[' .. compare .. '],"success":[' .. success .. ']}')
end

function init(args)
  key = args[id + 1]
  acquire = txn(
    string.format('{"key":"%s","result":"EQUAL","target":"CREATE","create_revision":"0"}', key),
    string.format('{"request_put":{"key":"%s","value":"YmVuY2g="}}', key))
  revision, releasing, cycles, failures = nil, false, 0, 0
end

function request()
  releasing = revision ~= nil
  if releasing then
    local release = txn(
      string.format('{"key":"%s","result":"EQUAL","target":"MOD","mod_revision":"%s"}', key, revision),
      string.format('{"request_delete_range":{"key":"%s"}}', key))
    revision = nil
    return release
  end
  return acquire
end

function response(status, headers, body)
  local succeeded = status == 200 and body:find('"succeeded":true', 1, true) ~= nil
  if not succeeded then
    failures = failures + 1
  elseif releasing then
    cycles = cycles + 1
  else
    revision = body:match('"revision":"(%d+)"')  -- the header's: the put's revision
  end
end

function done(summary, latency, requests)
  local total, failed = 0, 0
  for _, thread in ipairs(threads) do
    total = total + thread:get("cycles")
    failed = failed + thread:get("failures")
  end
  local errors = summary.errors  -- sockets: a cycle cut by one leaves its key taken
  failed = failed + errors.connect + errors.read + errors.write + errors.timeout
  io.write(string.format('RESULT {"cycles": %d, "failures": %d, "seconds": %f, "p50_ms": %f, "p99_ms": %f}\n',
    total, failed, summary.duration / 1e6, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
