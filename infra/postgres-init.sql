-- The fleet's two databases on one PostgreSQL server (README "Running as a fleet"), each with a
-- user of its own that owns it and can connect to nothing else of the fleet's:
--   prefect  harvest_prefect  the control plane's Prefect database (PREFECT_API_DATABASE_CONNECTION_URL)
--   jobs     harvest_jobs     the job store of the API replicas (HARVEST_DATABASE_URL)
-- The superuser (POSTGRES_USER) is the operator's alone. The users' passwords come from the
-- server's environment, JOBS_DB_PASSWORD and PREFECT_DB_PASSWORD (psql's \getenv, psql >= 15).
--
-- Mounted into /docker-entrypoint-initdb.d/ by infra/compose.yaml, so the postgres image runs
-- it once, as POSTGRES_USER, on the first start of an EMPTY data volume, and never again (a
-- volume that already holds a cluster skips it). It can be run again by hand, as the superuser
-- (RUNBOOK "Threat model": a volume made before the roles had users of their own; a password
-- changed): it creates what is missing, sets both passwords, and hands each user its database
-- and every object in it. Each role creates its own tables: Prefect's server (`harvest server`)
-- migrates Prefect's database (pg_trgm, which it creates, is a trusted extension: its
-- database's owner may), an API replica runs the job store's Alembic migrations on start
-- (serialised by an advisory lock).
\set ON_ERROR_STOP on

\getenv jobs_password JOBS_DB_PASSWORD
\getenv prefect_password PREFECT_DB_PASSWORD
\if :{?jobs_password}
\else
  \set jobs_password ''
\endif
\if :{?prefect_password}
\else
  \set prefect_password ''
\endif
SELECT :'jobs_password' = '' AS no_jobs_password, :'prefect_password' = '' AS no_prefect_password \gset
\if :no_jobs_password
  DO $$ BEGIN RAISE EXCEPTION 'set JOBS_DB_PASSWORD (the job store user''s password) in the server''s environment'; END $$;
\endif
\if :no_prefect_password
  DO $$ BEGIN RAISE EXCEPTION 'set PREFECT_DB_PASSWORD (Prefect''s database user''s password) in the server''s environment'; END $$;
\endif

-- The users: log in, nothing more (no superuser, no CREATEDB, no CREATEROLE).
SELECT 'CREATE ROLE harvest_jobs LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'harvest_jobs') \gexec
SELECT 'CREATE ROLE harvest_prefect LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'harvest_prefect') \gexec
ALTER ROLE harvest_jobs WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'jobs_password';
ALTER ROLE harvest_prefect WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'prefect_password';

-- The databases, each its user's; nobody else may connect (the superuser still can).
SELECT 'CREATE DATABASE prefect OWNER harvest_prefect' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'prefect') \gexec
SELECT 'CREATE DATABASE jobs OWNER harvest_jobs' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'jobs') \gexec
ALTER DATABASE prefect OWNER TO harvest_prefect;
ALTER DATABASE jobs OWNER TO harvest_jobs;
REVOKE ALL ON DATABASE prefect FROM PUBLIC;
REVOKE ALL ON DATABASE jobs FROM PUBLIC;

-- Inside each database: its schema, and whatever an earlier version of this recipe created in
-- it as the superuser, become its user's (a table carries its indexes and owned sequences).
\set owner harvest_prefect
\connect prefect
ALTER SCHEMA public OWNER TO :"owner";
SELECT format('ALTER %s %s OWNER TO %I', o.kind, o.name, :'owner')
  FROM (SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END,
               c.oid::regclass::text, c.relowner, c.oid, 'pg_class'::regclass
          FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        UNION ALL
        SELECT 'TYPE', t.oid::regtype::text, t.typowner, t.oid, 'pg_type'::regclass
          FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace AND t.typtype IN ('e', 'd')
        UNION ALL
        SELECT CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE' ELSE 'FUNCTION' END,
               p.oid::regprocedure::text, p.proowner, p.oid, 'pg_proc'::regclass
          FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace) AS o(kind, name, owner, oid, cls)
 WHERE o.owner <> :'owner'::regrole::oid
   -- not an extension's (pg_trgm's functions), nor a sequence or type that moves with its table
   AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = o.cls AND d.objid = o.oid AND d.deptype IN ('a', 'i', 'e'))
\gexec

\set owner harvest_jobs
\connect jobs
ALTER SCHEMA public OWNER TO :"owner";
SELECT format('ALTER %s %s OWNER TO %I', o.kind, o.name, :'owner')
  FROM (SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END,
               c.oid::regclass::text, c.relowner, c.oid, 'pg_class'::regclass
          FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        UNION ALL
        SELECT 'TYPE', t.oid::regtype::text, t.typowner, t.oid, 'pg_type'::regclass
          FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace AND t.typtype IN ('e', 'd')
        UNION ALL
        SELECT CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE' ELSE 'FUNCTION' END,
               p.oid::regprocedure::text, p.proowner, p.oid, 'pg_proc'::regclass
          FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace) AS o(kind, name, owner, oid, cls)
 WHERE o.owner <> :'owner'::regrole::oid
   -- not an extension's (pg_trgm's functions), nor a sequence or type that moves with its table
   AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = o.cls AND d.objid = o.oid AND d.deptype IN ('a', 'i', 'e'))
\gexec
