//! A progress bar on stderr (blocks read / blocks planned) for queries that
//! run longer than a second in a terminal.

use std::sync::Arc;
use std::time::Duration;

use datafusion::prelude::SessionContext;
use indicatif::{ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;
use zarrfusion::ScanProgress;

/// The bar of one running query; drawn only after a second.
pub struct ProgressBar {
    task: Option<JoinHandle<()>>,
    bar: Option<indicatif::ProgressBar>,
}

impl ProgressBar {
    /// Resets the session's scan counters and, when `show`, starts watching them.
    pub fn start(ctx: &SessionContext, show: bool) -> Self {
        let progress = ctx.state().config().get_extension::<ScanProgress>();
        if let Some(p) = &progress {
            p.reset();
        }
        let (Some(progress), true) = (progress, show) else {
            return Self {
                task: None,
                bar: None,
            };
        };
        let bar = indicatif::ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} blocks",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let watched = bar.clone();
        let task = tokio::spawn(watch(progress, watched));
        Self {
            task: Some(task),
            bar: Some(bar),
        }
    }

    /// Stops and clears the bar.
    pub fn finish(self) {
        if let Some(task) = self.task {
            task.abort();
        }
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}

async fn watch(progress: Arc<ScanProgress>, bar: indicatif::ProgressBar) {
    tokio::time::sleep(Duration::from_secs(1)).await;
    loop {
        let (done, total) = progress.snapshot();
        bar.set_length(total);
        bar.set_position(done);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
