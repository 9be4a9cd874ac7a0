from bench.agents.run import main

main()
