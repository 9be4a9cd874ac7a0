from bench.kv_tiers.run import main

main()
