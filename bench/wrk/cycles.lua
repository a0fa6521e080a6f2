-- bench/run.py's cross-check: wrk -t N -c N, a thread per connection, so that request() and
-- response() alternate and each thread runs whole lock cycles on a key of its own.
-- Arguments: the side, then its own. helix and bare: the API key (empty: none sent) and a key
-- prefix (POST /v1/locks, then DELETE /v1/locks/{id}). etcd: the keys, base64, one per thread (a
-- put-if-absent transaction, then a compare-and-delete on the put's revision).
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
  side, held, releasing, cycles, failures = args[1], nil, false, 0, 0
  lock_api = side ~= "etcd"  -- helix, or the bare app: the same requests
  if lock_api then
    auth = {}
    if args[2] ~= "" then auth["Authorization"] = "Bearer " .. args[2] end
    local body = string.format(
      '{"organization_id":"bench","job_type":"%s-%d","holder":"wrk","ttl_seconds":30}', args[3], id)
    local headers = {["Content-Type"] = "application/json"}
    for name, value in pairs(auth) do headers[name] = value end
    acquire = wrk.format("POST", "/v1/locks", headers, body)
  else
    key = args[id + 2]
    acquire = txn(
      string.format('{"key":"%s","result":"EQUAL","target":"CREATE","create_revision":"0"}', key),
      string.format('{"request_put":{"key":"%s","value":"YmVuY2g="}}', key))
  end
end

-- What releases the lock this thread holds (held: what the acquire's answer said).
local function release()
  if lock_api then
    local headers = {["Lock-Token"] = held.token}
    for name, value in pairs(auth) do headers[name] = value end
    return wrk.format("DELETE", "/v1/locks/" .. held.id, headers)
  end
  return txn(
    string.format('{"key":"%s","result":"EQUAL","target":"MOD","mod_revision":"%s"}', key, held.revision),
    string.format('{"request_delete_range":{"key":"%s"}}', key))
end

function request()
  releasing = held ~= nil
  if releasing then
    local r = release()
    held = nil
    return r
  end
  return acquire
end

function response(status, headers, body)
  if lock_api then
    if releasing and status == 204 then
      cycles = cycles + 1
    elseif not releasing and status == 201 then
      held = {id = body:match('"id":(%d+)'), token = body:match('"token":"(%x+)"')}
    else
      failures = failures + 1
    end
  elseif not (status == 200 and body:find('"succeeded":true', 1, true)) then
    failures = failures + 1
  elseif releasing then
    cycles = cycles + 1
  else
    held = {revision = body:match('"revision":"(%d+)"')}  -- the header's: the put's revision
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
