from bench.tool_affinity.run import main

main()
