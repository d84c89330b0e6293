//! The demo's output: one line per event, stamped with the seconds since the demo started;
//! in colour on a terminal, plain text otherwise (`--ci`, or output to a pipe or a file).
//! A completion streamed by curl prints its tokens on one growing line as they arrive;
//! another event in the middle of it breaks the line and the tokens continue on a new one.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Set by SIGINT or SIGTERM, by a failed write (whoever reads our output is gone), or by an
/// error: every loop of the demo checks it and winds down.
static STOP: AtomicBool = AtomicBool::new(false);

pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Plain,
    /// A section title.
    Title,
    /// A command the demo runs, as the operator would type it.
    Command,
    /// A spill, as the agent logs it.
    Spill,
    /// Another event of the agent's (saturation, drain, reload).
    Event,
    /// Something that went wrong.
    Warn,
    /// Output of a command, tables.
    Dim,
}

impl Style {
    fn code(self) -> &'static str {
        match self {
            Style::Plain | Style::Dim => "",
            Style::Title => "\x1b[1m",
            Style::Command => "\x1b[36m",
            Style::Spill => "\x1b[1;33m",
            Style::Event => "\x1b[35m",
            Style::Warn => "\x1b[1;31m",
        }
    }
}

pub struct Out {
    start: Instant,
    color: bool,
    /// The prefix of the token line that is unfinished on screen, if one is.
    tokens: Mutex<Option<String>>,
}

/// Width of the time stamp, `[ 12.3s] `, for lines that continue without one.
pub const INDENT: &str = "         ";

impl Out {
    pub fn new(color: bool) -> Self {
        Self {
            start: Instant::now(),
            color,
            tokens: Mutex::new(None),
        }
    }

    pub fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn stamp(&self) -> String {
        format!("[{:5.1}s] ", self.elapsed_s())
    }

    fn styled(&self, style: Style, text: &str) -> String {
        let code = style.code();
        if self.color && !code.is_empty() {
            format!("{code}{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn write(&self, text: &str) {
        let mut stdout = std::io::stdout().lock();
        if stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            request_stop();
        }
    }

    /// Ends an unfinished token line before other output; the next token starts a new one.
    fn break_tokens(&self, open: &mut Option<String>, text: &mut String) {
        if open.take().is_some() {
            text.insert(0, '\n');
        }
    }

    /// One stamped line; a text of several lines continues indented under the stamp.
    pub fn line(&self, style: Style, text: &str) {
        let mut open = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let mut body = String::new();
        for (i, l) in text.lines().enumerate() {
            let lead = if i == 0 { self.stamp() } else { INDENT.into() };
            body.push_str(&lead);
            body.push_str(&self.styled(style, l));
            body.push('\n');
        }
        if text.is_empty() {
            body.push('\n');
        }
        self.break_tokens(&mut open, &mut body);
        self.write(&body);
    }

    /// Lines without a stamp, indented under the previous one (a table, a file).
    pub fn block(&self, style: Style, text: &str) {
        let mut open = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let mut body = String::new();
        for l in text.lines() {
            body.push_str(INDENT);
            body.push_str(&self.styled(style, l));
            body.push('\n');
        }
        self.break_tokens(&mut open, &mut body);
        self.write(&body);
    }

    /// Text without a stamp or indentation (the banner).
    pub fn raw(&self, style: Style, text: &str) {
        let mut open = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let mut body = String::new();
        for l in text.lines() {
            body.push_str(&self.styled(style, l));
            body.push('\n');
        }
        self.break_tokens(&mut open, &mut body);
        self.write(&body);
    }

    /// Appends `text` to the token line that starts with `prefix`, as it arrives.
    pub fn tokens(&self, prefix: &str, text: &str) {
        let mut open = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        let mut body = String::new();
        if open.is_none() {
            body.push_str(&self.stamp());
            body.push_str(&self.styled(Style::Command, prefix));
        }
        // A real model's text has line breaks: they continue under the prefix.
        let continued = format!("\n{INDENT}{}", self.styled(Style::Command, prefix));
        body.push_str(&text.replace('\n', &continued));
        *open = Some(prefix.to_owned());
        self.write(&body);
    }

    /// Ends the token line.
    pub fn end_tokens(&self) {
        let mut open = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        if open.take().is_some() {
            self.write("\n");
        }
    }
}
