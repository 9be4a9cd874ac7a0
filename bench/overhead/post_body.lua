-- wrk script: POST the JSON body in $TW_BENCH_BODY with an API key (bench/overhead/apis.py).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("TW_BENCH_KEY") or "none")
wrk.body = os.getenv("TW_BENCH_BODY") or "{}"
