-- wrk script: POST one small chat completion with an API key.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("TW_BENCH_KEY") or "none")
if os.getenv("TW_BENCH_TAGS") then wrk.headers["x-tokenway-tags"] = os.getenv("TW_BENCH_TAGS") end
wrk.body = '{"model":"bench-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Say hello in one word."}],"max_tokens":8}'
