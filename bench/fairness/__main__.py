from bench.fairness.run import main

main()
