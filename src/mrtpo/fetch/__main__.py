from mrtpo.fetch.cli import main

raise SystemExit(main())
