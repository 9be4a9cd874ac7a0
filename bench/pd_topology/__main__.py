from bench.pd_topology.run import main

main()
