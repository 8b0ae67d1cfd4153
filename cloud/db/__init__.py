"""The cloud store's database plumbing: URLs and engines (:mod:`.engine`), the tables (:mod:`.schema`),
and Alembic migrations (:mod:`.migrate`, revisions under ``migrations/versions``)."""
