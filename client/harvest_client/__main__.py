from harvest_client.cli import main

raise SystemExit(main())
