"""The processes of a deployment, above `api/` and `flows/` (which never import this package).

    cli.py          the `harvest` command: which module runs each subcommand
    roles.py        `harvest server|api|worker`: one role each
    prefect_server.py  the control plane's Prefect server process (Prefect's app, short Retry-After on 503s)
    stack.py        `harvest up` (what `make run` runs): the roles on one box
    processes.py    process supervision: start children, watch and restart them (`Supervisor`),
                    stop them with everything they started; `serve` runs a role
    run_starter.py  a worker host's fork server: its flow runs start in milliseconds
    run_fork.py     what the run starter checks and does around each fork

Dependency direction: `fleet → api, flows → tasks → harvest`.
"""
