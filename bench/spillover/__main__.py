from bench.spillover.run import main

main()
