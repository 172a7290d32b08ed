"""Packaging that pyproject.toml cannot say: the migrations ride inside the wheel.

The migrations live at the top of the repository in the standard Alembic layout (``alembic/``,
no ``__init__.py``, so it never shadows the Alembic library). The wheel carries exactly those
files as ``ductor_celery/_alembic/`` (``env.py``, ``script.py.mako``, ``versions/*.py``):
``package_dir`` maps the two package names onto the two directories, so the build copies them
and there is one source. Installed, ``ductor_celery.store.migrate`` finds them there; in a
checkout or an editable install it uses ``alembic/`` itself. Everything else is in
pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

# As pyproject.toml's [tool.setuptools.packages.find] would find them (namespaces included).
PACKAGES = find_namespace_packages(
    include=["ductor_celery", "ductor_celery.*"], exclude=["*.__pycache__"]
)
MIGRATIONS = ["ductor_celery._alembic", "ductor_celery._alembic.versions"]

setup(
    packages=[*PACKAGES, *MIGRATIONS],
    package_dir={"ductor_celery._alembic": "alembic"},
    package_data={
        "ductor_celery": ["py.typed"],
        "ductor_celery._alembic": ["script.py.mako"],
        # The console's templates and assets: it must work with no internet access.
        "ductor_celery.web": ["templates/*.html", "static/*.css", "static/*.js"],
    },
)
