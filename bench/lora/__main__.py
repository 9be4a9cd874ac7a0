from bench.lora.run import main

raise SystemExit(main())
