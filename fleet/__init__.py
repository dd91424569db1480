"""The processes of a deployment, above `api/` and `flows/` (which never import this package).

    cli.py          the `harvest` command: which module runs each subcommand
    roles.py        `harvest server|api|worker`: one role each, supervised (`Supervisor`)
    stack.py        `harvest up` (what `make run` runs): the roles on one box
    processes.py    child processes: start, wait for, stop (with everything they started)
    run_starter.py  a worker host's fork server: its flow runs start in milliseconds

Dependency direction: `fleet → api, flows → tasks → harvest`.
"""
