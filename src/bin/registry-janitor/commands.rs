//! The commands that ask or tell the service something: one function each. Each loads
//! what it needs from the library, runs it, and hands what it prints to [`crate::output`].

use anyhow::Context;
use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    dead_letters,
    event::{ServerDead, ServerId},
    keys::Keys,
    status, stream,
};

use crate::{
    cli::{DeadLettersAction, EmitEvent, FormatAction, HeldAction},
    output,
};

/// `emit server-dead`: publishes one event and prints its entry id.
pub async fn emit(settings: &Settings, event: EmitEvent) -> anyhow::Result<()> {
    let EmitEvent::ServerDead {
        server_id,
        reason,
        source,
    } = event;
    let server = ServerId::parse(&server_id).context("SERVER_ID")?;
    let event = ServerDead::new(&server, reason, Some(source));
    event.validate().context("the event")?;
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let id = stream::publish_event(&conn, &keys, &event.encode())
        .await
        .with_context(|| format!("publishing to {}", conn::redact_url(&settings.redis_url)))?;
    output::emitted(&id);
    Ok(())
}

/// `status [--json]`.
pub async fn status(settings: &Settings, json: bool) -> anyhow::Result<()> {
    let report = status::collect(settings).await?;
    output::status(&report, json)
}

/// `dead-letters list|replay|purge`.
pub async fn dead_letters(settings: &Settings, action: DeadLettersAction) -> anyhow::Result<()> {
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    match action {
        DeadLettersAction::List { count, json } => {
            let letters = dead_letters::list(&conn, &keys, count).await?;
            output::dead_letters(&letters, json)?;
        }
        DeadLettersAction::Replay { ids, all } => {
            anyhow::ensure!(
                all || !ids.is_empty(),
                "name the dead-letter ids to replay, or --all"
            );
            output::replayed(&dead_letters::replay(&conn, &keys, &ids).await?);
        }
        DeadLettersAction::Purge { ids, all, yes } => purge(&conn, &keys, ids, all, yes).await?,
    }
    Ok(())
}

/// `held list|release|discard`: the guard's held verdicts.
pub async fn held(settings: &Settings, action: HeldAction) -> anyhow::Result<()> {
    use registry_janitor::guard::hold;
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let holds = hold::list(&conn, &keys).await?;
    let chosen = |servers: &[String], all: bool| -> anyhow::Result<Vec<_>> {
        anyhow::ensure!(
            all || !servers.is_empty(),
            "name the servers whose held verdict to act on, or --all"
        );
        for s in servers {
            anyhow::ensure!(
                holds.iter().any(|h| &h.server_id == s),
                "no verdict is held for server {s}"
            );
        }
        Ok(holds
            .iter()
            .filter(|h| all || servers.contains(&h.server_id))
            .cloned()
            .collect())
    };
    match action {
        HeldAction::List { json } => output::holds(&holds, json)?,
        HeldAction::Release { servers, all } => {
            for h in chosen(&servers, all)? {
                if hold::release(&conn, &keys, &h, settings.claim_min_idle_ms).await? {
                    println!("{}: released; a worker fences and cleans it", h.server_id);
                } else {
                    println!(
                        "{}: its hold had ended meanwhile; nothing done",
                        h.server_id
                    );
                }
            }
        }
        HeldAction::Discard { servers, all } => {
            for h in chosen(&servers, all)? {
                let why = format!(
                    "discarded from the guard's hold by an operator (it was held as {}: {})",
                    h.doubt.as_str(),
                    h.detail
                );
                if hold::discard(&conn, &keys, &h, &why).await? {
                    println!(
                        "{}: discarded; its event is in the dead-letter stream",
                        h.server_id
                    );
                } else {
                    println!(
                        "{}: its hold had ended meanwhile; nothing done",
                        h.server_id
                    );
                }
            }
        }
    }
    Ok(())
}

/// `format status|set`: the data format.
pub async fn format(settings: &Settings, action: FormatAction) -> anyhow::Result<()> {
    use registry_janitor::format;
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let keys = Keys::for_settings(settings);
    let live_ms = settings.claim_min_idle_ms;
    match action {
        FormatAction::Status { json } => {
            let status = format::status(&conn, &keys, format::Build::current()?, live_ms).await?;
            output::format_status(&status, json)?;
        }
        FormatAction::Set { format: n, force } => {
            let outcome = format::set(&conn, &keys, n, live_ms, force).await?;
            output::format_set(n, &outcome, live_ms)?;
        }
    }
    Ok(())
}

async fn purge(
    conn: &RedisConn,
    keys: &Keys,
    ids: Vec<String>,
    all: bool,
    yes: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        all || !ids.is_empty(),
        "name the dead-letter ids to purge, or --all"
    );
    anyhow::ensure!(
        yes,
        "purging deletes dead letters for good: add --yes to confirm"
    );
    output::purged(dead_letters::purge(conn, keys, &ids).await?);
    Ok(())
}
