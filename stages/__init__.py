"""The stages and the code they share. Importing the package switches off the usage reports of the
libraries the stages drive (storage.settings.NO_TELEMETRY), before any of them is imported."""

from storage.settings import no_telemetry

no_telemetry()
