from bench.autoscale.run import main

main()
