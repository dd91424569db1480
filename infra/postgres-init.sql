-- The fleet's two databases on one PostgreSQL server (README "Running as a fleet"):
--   prefect  the control plane's Prefect database (PREFECT_API_DATABASE_CONNECTION_URL)
--   jobs     the job store of the API replicas (HARVEST_DATABASE_URL)
--
-- Mounted into /docker-entrypoint-initdb.d/ by infra/compose.yaml, so the postgres image runs
-- it once, as POSTGRES_USER, on the first start of an EMPTY data volume, and never again (a
-- volume that already holds a cluster skips it). Both databases belong to POSTGRES_USER.
-- Each role creates its own tables: Prefect's server (`harvest server`) migrates Prefect's database, an API
-- replica runs the job store's Alembic migrations on start (serialised by an advisory lock).
CREATE DATABASE prefect;
CREATE DATABASE jobs;
